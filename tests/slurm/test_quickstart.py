"""launch/quickstart.sh's closing depth sweep evaluates on the run's own validation set: without
``--data`` it read the embedded one, so a run on other data (another tokenizer) trained and then
exited 2; a run on other data without ``data.val_path`` skips the sweep with a note. Overrides'
paths are relative to the caller's directory (the script changed into the repository).
``megaloop`` is a stub here that records its argv and writes the run's config.yaml."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, clean_env
from tests.slurm.stubs import fake_venv

_MEGALOOP = r'''
import json, os, sys
argv = sys.argv[1:]
with open(os.environ["QS_LOG"], "a") as f:
    f.write(json.dumps({"argv": argv, "cwd": os.getcwd()}) + "\n")
if argv[0] == "train":
    run = argv[argv.index("--run-dir") + 1]
    kv = dict(a.split("=", 1) for a in argv if "=" in a and not a.startswith("-"))
    os.makedirs(run, exist_ok=True)
    val = kv.get("data.val_path")
    with open(os.path.join(run, "config.yaml"), "w") as f:
        f.write("data:\n  path: %s\n  val_path: %s\n" % (kv.get("data.path", "default"), val or "null"))
    with open(os.path.join(run, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": 1, "loss": 5.0}) + "\n")
'''


def _put(bin_dir: Path) -> None:
    for name, body in (("python", f'#!/bin/sh\nexec {sys.executable} "$@"\n'),
                       ("megaloop", f"#!{sys.executable}\n{_MEGALOOP}")):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod((bin_dir / name).stat().st_mode | stat.S_IXUSR)


@pytest.mark.parametrize("overrides, data", [
    ([], "default"),  # the embedded corpus: its validation set, as before
    (["data.path=mds", "data.val_path=mds_val"], "mds_val"),
    (["data.path=default_mds"], None),  # a folder named like the corpus is other data: no sweep
    (["data.path=mds"], None),
])
def test_the_closing_sweep_reads_the_runs_validation_set(tmp_path: Path, overrides: list[str], data) -> None:
    venv = fake_venv(tmp_path, _put)
    log = tmp_path / "calls.jsonl"
    work = tmp_path / "work"
    work.mkdir()
    env = {**clean_env(), "MEGALOOP_VENV": str(venv), "QS_LOG": str(log), "RUN_DIR": "run"}
    proc = subprocess.run(["bash", str(ROOT / "launch" / "quickstart.sh"), *overrides], cwd=work, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = [json.loads(x) for x in log.read_text().splitlines()]
    assert calls[0]["argv"][0] == "train" and calls[0]["cwd"] == str(work)  # overrides mean what they say here
    assert calls[0]["argv"][calls[0]["argv"].index("--run-dir") + 1] == str(work / "run")
    sweeps = [c["argv"] for c in calls if c["argv"][:2] == ["eval", "sweep"]]
    if data is None:
        assert sweeps == [] and "depth sweep skipped: the run has no data.val_path" in proc.stdout
    else:
        assert len(sweeps) == 1 and sweeps[0][sweeps[0].index("--data") + 1] == data
