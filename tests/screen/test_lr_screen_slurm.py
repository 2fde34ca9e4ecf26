"""megaloop lr-screen --launcher slurm with stub sbatch/squeue: one array job over the unfinished
points, task files that slurm/sweep_array.sh reads, no double submission, --wait."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megaloop.screen import cli
from megaloop.screen.core import lr_tag
from tests.conftest import ROOT
from tests.screen.slurm_stubs import sweep_stubs
from tests.slurm.stubs import calls

GRID = "1e-3,2e-3,4e-3"


@pytest.fixture
def stubs(tmp_path: Path, monkeypatch):
    return sweep_stubs(tmp_path, monkeypatch, job_id="777")


def _main(out: Path, *extra: str) -> int:
    return cli.main(["--config", "tiny", "--grid", GRID, "--launcher", "slurm", "--stop-after", "6",
                     "--out", str(out), *extra, "--", "train.micro_batch_size=4"])


def _finish(out: Path, lr: float, ce: float) -> None:
    run = out / f"lr_{lr_tag(lr)}"
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 6, "loss": 4.0, "val_ce": ce, "val_ppl": 50.0,
                                                   "val_depth": 5}) + "\n")
    (run / "screen_exit").write_text("0\n")


def test_submit_array_then_no_double_submission(stubs: Path, capsys) -> None:
    out = stubs / "screen"
    assert _main(out, "--parallel", "2", "--sbatch-arg=--partition=gpu") == 0
    (sb,) = calls(stubs, "sbatch")
    argv = sb["argv"]
    assert "--array=0-2%2" in argv and "--parsable" in argv and "--partition=gpu" in argv
    assert argv[-1] == str(ROOT / "slurm" / "sweep_array.sh")
    assert f"--output={out}/slurm/%A_%a.out" in argv
    assert sb["env"]["SWEEP_DIR"] == str(out) and sb["env"]["MEGALOOP_ROOT"] == str(ROOT)
    assert sb["env"]["SWEEP_TASKS"] == str(out / "slurm" / "sub000") and sb["env"]["SWEEP_EXIT_FILE"] == "screen_exit"
    for i, lr in enumerate(["0.001", "0.002", "0.004"]):
        lines = (out / "slurm" / "sub000" / f"task_{i}.args").read_text().splitlines()
        assert lines[:2] == ["tiny", str(out / f"lr_{lr}")]
        assert f"optim.lr={lr}" in lines and "train.stop_after=6" in lines
        assert "data.val_path=default:screen" in lines and "train.eval_depth=5" in lines
        assert lines[-1] == "train.micro_batch_size=4"  # user overrides last
        assert "--resume" not in lines  # slurm/common.sh always adds --resume auto
    job = json.loads((out / "slurm" / "jobs.jsonl").read_text())
    assert job["job_id"] == "777" and job["runs"] == {"0": "lr_0.001", "1": "lr_0.002", "2": "lr_0.004"}
    assert not list((out / "slurm" / "sub000").glob("*.after"))  # a screen point only trains
    capsys.readouterr()

    # while the array is queued, a rerun submits nothing
    (stubs / "squeue.out").write_text("777_0\n777_1\n777_2\n")
    assert _main(out) == 0
    assert len(calls(stubs, "sbatch")) == 1
    text = capsys.readouterr().out
    assert text.count("still queued/running in slurm job 777") == 3
    assert json.loads((out / "results.json").read_text())["points"][0]["status"] == "queued"

    # point 1 finished, the others died without a result: only 0 and 2 are resubmitted
    (stubs / "squeue.out").write_text("")
    _finish(out, 2e-3, 4.0)
    assert _main(out) == 0
    sb2 = calls(stubs, "sbatch")[-1]
    assert "--array=0,2" in sb2["argv"] and sb2["env"]["SWEEP_TASKS"].endswith("sub001")
    assert sorted(p.name for p in (out / "slurm" / "sub001").iterdir()) == ["task_0.args", "task_2.args"]


def test_wait_then_report(stubs: Path, capsys) -> None:
    out = stubs / "screen"
    for lr, ce in zip([1e-3, 2e-3, 4e-3], [4.5, 4.1, 4.3]):
        _finish(out, lr, ce)
    # every point finished: nothing to submit, the report is written
    assert _main(out, "--wait", "--poll", "0.01") == 0
    assert not calls(stubs, "sbatch")
    res = json.loads((out / "results.json").read_text())
    assert res["best"]["lr"] == 2e-3 and res["interior"] is True
    # with pending points, --wait polls squeue until the array is gone, then collects
    out2 = stubs / "screen2"
    assert _main(out2, "--wait", "--poll", "0.01") == 1  # stubs never train: unfinished
    assert calls(stubs, "squeue")
    assert "job 777: no task left" in capsys.readouterr().out
    assert json.loads((out2 / "results.json").read_text())["complete"] is False


def test_dry_run_prints_sbatch(stubs: Path, capsys) -> None:
    assert _main(stubs / "dry", "--dry-run") == 0
    text = capsys.readouterr().out
    assert "sbatch --parsable --array=0-2" in text and text.count("  task ") == 3
    assert not calls(stubs, "sbatch") and not (stubs / "dry").exists()
