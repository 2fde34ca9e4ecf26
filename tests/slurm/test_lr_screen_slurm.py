"""tools/lr_screen.py --launcher slurm with stub sbatch/squeue: one array job over the unfinished
points, point files that slurm/lr_screen_array.sh reads, no double submission, --wait."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.slurm.stubs import calls, stub_env

_TOOL = ROOT / "tools" / "lr_screen.py"
GRID = "1e-3,2e-3,4e-3"


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("lr_screen_tool_slurm", _TOOL)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def stubs(tmp_path: Path, monkeypatch):
    env = stub_env(tmp_path, STUB_JOB_ID="777")
    for k in list(os.environ):
        if k.startswith("SLURM_"):
            monkeypatch.delenv(k)
    for k in ("PATH", "STUB_LOG", "STUB_DIR", "STUB_JOB_ID"):
        monkeypatch.setenv(k, env[k])
    return tmp_path


def _main(tool, out: Path, *extra: str) -> int:
    return tool.main(["--config", "tiny", "--grid", GRID, "--launcher", "slurm", "--stop-after", "6",
                      "--out", str(out), *extra, "--", "train.micro_batch_size=4"])


def _finish(tool, out: Path, lr: float, ce: float) -> None:
    run = out / f"lr_{tool.lr_tag(lr)}"
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 6, "loss": 4.0, "val_ce": ce, "val_ppl": 50.0,
                                                   "val_depth": 5}) + "\n")
    (run / "screen_exit").write_text("0\n")


def test_submit_array_then_no_double_submission(tool, stubs: Path, capsys) -> None:
    out = stubs / "screen"
    assert _main(tool, out, "--parallel", "2", "--sbatch-arg=--partition=gpu") == 0
    (sb,) = calls(stubs, "sbatch")
    argv = sb["argv"]
    assert "--array=0-2%2" in argv and "--parsable" in argv and "--partition=gpu" in argv
    assert argv[-1] == str(ROOT / "slurm" / "lr_screen_array.sh")
    assert f"--output={out}/slurm/%A_%a.out" in argv
    assert sb["env"]["SCREEN_DIR"] == str(out) and sb["env"]["MEGALOOP_ROOT"] == str(ROOT)
    assert sb["env"]["SCREEN_POINTS_DIR"] == str(out / "slurm" / "sub000")
    for i, lr in enumerate(["0.001", "0.002", "0.004"]):
        lines = (out / "slurm" / "sub000" / f"point_{i}.args").read_text().splitlines()
        assert lines[:2] == ["tiny", str(out / f"lr_{lr}")]
        assert f"optim.lr={lr}" in lines and "train.stop_after=6" in lines
        assert "data.val_path=default:screen" in lines and "train.eval_depth=5" in lines
        assert lines[-1] == "train.micro_batch_size=4"  # user overrides last
        assert "--resume" not in lines  # slurm/common.sh always adds --resume auto
    job = json.loads((out / "slurm" / "jobs.jsonl").read_text())
    assert job["job_id"] == "777" and job["lrs"] == {"0": 0.001, "1": 0.002, "2": 0.004}
    capsys.readouterr()

    # while the array is queued, a rerun submits nothing
    (stubs / "squeue.out").write_text("777_0\n777_1\n777_2\n")
    assert _main(tool, out) == 0
    assert len(calls(stubs, "sbatch")) == 1
    text = capsys.readouterr().out
    assert text.count("still queued/running in slurm job 777") == 3
    assert json.loads((out / "results.json").read_text())["points"][0]["status"] == "queued"

    # point 1 finished, the others died without a result: only 0 and 2 are resubmitted
    (stubs / "squeue.out").write_text("")
    _finish(tool, out, 2e-3, 4.0)
    assert _main(tool, out) == 0
    sb2 = calls(stubs, "sbatch")[-1]
    assert "--array=0,2" in sb2["argv"] and sb2["env"]["SCREEN_POINTS_DIR"].endswith("sub001")
    assert sorted(p.name for p in (out / "slurm" / "sub001").iterdir()) == ["point_0.args", "point_2.args"]


def test_wait_then_report(tool, stubs: Path, capsys) -> None:
    out = stubs / "screen"
    for lr, ce in zip([1e-3, 2e-3, 4e-3], [4.5, 4.1, 4.3]):
        _finish(tool, out, lr, ce)
    # every point finished: nothing to submit, the report is written
    assert _main(tool, out, "--wait", "--poll", "0.01") == 0
    assert not calls(stubs, "sbatch")
    res = json.loads((out / "results.json").read_text())
    assert res["best"]["lr"] == 2e-3 and res["interior"] is True
    # with pending points, --wait polls squeue until the array is gone, then collects
    out2 = stubs / "screen2"
    assert _main(tool, out2, "--wait", "--poll", "0.01") == 1  # stubs never train: unfinished
    assert calls(stubs, "squeue")
    assert "job 777: no task left" in capsys.readouterr().out
    assert json.loads((out2 / "results.json").read_text())["complete"] is False


def test_dry_run_prints_sbatch(tool, stubs: Path, capsys) -> None:
    assert _main(tool, stubs / "dry", "--dry-run") == 0
    text = capsys.readouterr().out
    assert "sbatch --parsable --array=0-2" in text and text.count("point ") == 3
    assert not calls(stubs, "sbatch") and not (stubs / "dry").exists()
