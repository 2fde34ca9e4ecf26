"""The developer tools under tools/plan_validation and tools/gpu on bad input: one line naming the
file or option and exit 2 (they were tracebacks: a missing or torn JSON file, an unknown --only name
after the synthetic data had been written, a torn steps.tsv line that failed the whole GPU summary)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT


def _tool(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=300, cwd=cwd)


def test_ab_compare_names_the_file_it_cannot_use(tmp_path: Path) -> None:
    tool = ROOT / "tools" / "plan_validation" / "ab_compare.py"
    good = ROOT / "tools" / "plan_validation" / "results.json"
    (tmp_path / "torn.json").write_text("{")
    (tmp_path / "mem.json").write_text(json.dumps({"mem_tp1": {"mode": "memory"}}))
    (tmp_path / "short.json").write_text(json.dumps({"time_pp2_fixed": {"mode": "timing"}}))
    for a, b, says in ((tmp_path / "none.json", good, f"{tmp_path / 'none.json'}: cannot be read as JSON"),
                       (good, tmp_path / "torn.json", f"{tmp_path / 'torn.json'}: cannot be read as JSON"),
                       (tmp_path / "mem.json", good, "holds no timing run"),
                       (tmp_path / "short.json", good, f"{tmp_path / 'short.json'} has no timing run 'time_pp2_fixed'")):
        proc = _tool(tool, "--a", a, "--b", b)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr and says in proc.stderr, (says, proc.stderr)
    proc = _tool(tool, "--a", good, "--b", good)
    assert proc.returncode == 0 and "makespan B/A 1.000 ± 0.000" in proc.stdout, proc.stderr


def test_plan_validation_refuses_bad_options_before_writing_anything(tmp_path: Path) -> None:
    tool = ROOT / "tools" / "plan_validation" / "run.py"
    (tmp_path / "torn.json").write_text("{")
    for args, says in ((["--only", "bogus"], "--only: give one or more of mem_tp1"),
                       (["--only"], "--only: give one or more of"),
                       (["--results", tmp_path / "torn.json"], f"--results {tmp_path / 'torn.json'}: cannot be read")):
        proc = _tool(tool, "--keep", tmp_path / "work", *args)
        assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert not (tmp_path / "work").exists()  # the synthetic data came first


def test_gpu_summary_and_calibration_on_torn_or_missing_files(tmp_path: Path) -> None:
    summarize, calib = ROOT / "tools" / "gpu" / "summarize.py", ROOT / "tools" / "gpu" / "plan_calibration.py"
    out = tmp_path / "out"
    out.mkdir()
    (out / "steps.tsv").write_text("probe\t0\t3\nlogits\t0\n")  # a torn last line
    (out / "plan_calibration.json").write_text("{")  # informational: fails nothing
    proc = _tool(summarize, out, "--mode", "cpu_smoke", "--runs")
    assert "Traceback" not in proc.stderr, proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == {"probe": {"rc": 0, "seconds": 3}} and summary["plan_calibration"] is None
    assert "steps.tsv line 2 is not NAME<TAB>RC<TAB>SECONDS: 'logits\\t0'" in summary["problems"]
    for args, says in (([summarize, tmp_path / "nothing", "--mode", "gpu"], "is not a folder"),
                       ([summarize, out, "--mode", "gpu", "--warmup", "-1"], "--warmup: must be >= 0"),
                       ([calib, out], f"{out / 'device.json'}: cannot be read")):
        proc = _tool(*args)
        assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
