"""``bash launch/synth.sh``, the synthetic task's one command, end to end at a toy size: it builds
the programs and their whole-document shards, trains, and prints and writes the k x R table; a
rerun reuses the data and the finished run; relative DATA_DIR / RUN_DIR are the caller's."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT


def _run(tmp: Path, expect: int = 0, **knobs: str) -> subprocess.CompletedProcess:
    # relative: to the caller's directory (they were the repository's, where the script cds)
    env = {**os.environ, "MEGALOOP_VENV": sys.prefix, "DATA_DIR": "data", "RUN_DIR": "run",
           "NUM_DOCS": "600", "DEPTHS": "1,2", "THREADS": "1", "WANDB_MODE": "offline",
           "SYNTH_ARGS": "--num-files 2 --eval-ks 1-2 --eval-per-k 3", **knobs}
    proc = subprocess.run(["bash", str(ROOT / "launch" / "synth.sh"), "train.max_steps=3", "train.save_interval=3", "optim.warmup_steps=1",
                           "train.global_batch_size=4", "train.micro_batch_size=4", "train.log_interval=1"],
                          env=env, cwd=tmp, capture_output=True, text=True, timeout=600)
    assert proc.returncode == expect, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_synth_launcher_builds_trains_and_prints_the_table(tmp_path: Path) -> None:
    first = _run(tmp_path)
    assert "answer accuracy" in first.stdout and "R=1" in first.stdout and "R=2" in first.stdout
    table = json.loads((tmp_path / "run" / "synth_table.json").read_text())
    assert table["ks"] == [1, 2] and table["depths"] == [1, 2] and table["n"] == [3, 3]
    assert (tmp_path / "run" / "synth_table.png").read_bytes()[:4] == b"\x89PNG"
    info = json.loads((tmp_path / "data" / "tree" / "synth.json").read_text())
    assert info["synth"]["mark_hidden"] and info["num_docs"] == 600
    manifest = json.loads((tmp_path / "data" / "train" / "manifest.json").read_text())
    assert manifest["packing"] == "whole"
    assert '"heldout": 6' in first.stdout and re.search(r"^step\s+3 loss=", first.stdout, re.M)
    again = _run(tmp_path)  # data and the finished run are reused: no programs written, no step trained
    assert '"heldout"' not in again.stdout and not re.search(r"^step\s+\d+ loss=", again.stdout, re.M)
    assert json.loads((tmp_path / "run" / "synth_table.json").read_text())["acc"] == table["acc"]
    # other programs asked for: the tree of the first build was reused silently; now refused, nothing touched
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "data").rglob("*"))
    other = _run(tmp_path, expect=2, NUM_DOCS="700")
    assert other.stderr.strip().splitlines()[-1] == (
        f"launch/synth.sh: {tmp_path / 'data' / 'tree'} was built with make_synth.py '--num-docs 600 --num-files 2 "
        "--eval-ks 1-2 --eval-per-k 3', not '--num-docs 700 --num-files 2 --eval-ks 1-2 --eval-per-k 3' (NUM_DOCS, "
        f"SYNTH_ARGS): give another DATA_DIR, or remove {tmp_path / 'data'} to rebuild it")
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "data").rglob("*")) == before
    # a tree of generator 1 (synth.json without "generator") may train on held-out answers: refused, not reused
    path = tmp_path / "data" / "tree" / "synth.json"
    path.write_text(json.dumps({k: v for k, v in info.items() if k != "generator"}))
    old = _run(tmp_path, expect=2)
    assert old.stderr.strip().splitlines()[-1] == (
        f"launch/synth.sh: {tmp_path / 'data' / 'tree'} was made by an earlier make_synth.py, whose training programs "
        f"could begin with a held-out program and show its answer: remove {tmp_path / 'data'} to rebuild it (and {tmp_path / 'run'}, "
        "which trained on it), or give another DATA_DIR and RUN_DIR")
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "data").rglob("*")) == before


def test_bad_eval_knobs_are_refused_before_anything_is_built(tmp_path: Path) -> None:
    """DEPTHS=1,x or THREADS=0 was refused by the final `eval synth`, after the data build and the training
    (about 15 minutes at the defaults)."""
    for knob, words in (("DEPTHS=1,x", "DEPTHS must be comma-separated integers"),
                        ("THREADS=0", "THREADS must be an integer >= 1")):
        key, value = knob.split("=")
        env = {**os.environ, "MEGALOOP_VENV": sys.prefix, "DATA_DIR": "data", "RUN_DIR": "run", key: value}
        proc = subprocess.run(["bash", str(ROOT / "launch" / "synth.sh")], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and words in proc.stderr, (knob, proc.stderr)
        assert list(tmp_path.iterdir()) == []
