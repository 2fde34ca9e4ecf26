"""Fixtures of the reproduction-suite tests: the command line, a user experiment YAML, fake runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

USER_YAML = """\
name: mine
description: Two fixed-depth arms that differ only in the TBPTT window.
scales:
  test:
    config: tiny
    overrides: "train.max_steps=2 optim.warmup_steps=1 train.save_interval=1 train.eval_batches=1"
    eval: {max_seqs: 2, depths: [1, 2, 4], harness_limit: 2, batch_size: 2}
common: "depth.kind=fixed depth.depth=2"
eval: {depth: 2}
arms:
  full: "model.bptt_window=2"
  b1: {label: "b=1", overrides: [model.bptt_window=1]}
claims:
  - {id: C2, claim: "b=1 keeps fixed points", paper: "<= 2 %", metrics: [extrapolation_pct], arms: [b1]}
  - {id: X, claim: "b=1 vs full", paper: "-", metrics: [native_ppl], arms: [b1], relative_to: full}
"""


@pytest.fixture(scope="session")
def tool():
    """``megaloop reproduce`` (megaloop/repro/cli.py; tools/reproduce.py wraps it)."""
    from megaloop.repro import cli

    return cli


@pytest.fixture
def user_yaml(tmp_path: Path) -> Path:
    path = tmp_path / "mine.yaml"
    path.write_text(USER_YAML)
    return path


def fake_checkpoint(run_dir: Path, step: int) -> None:
    """A directory that megaloop.train.checkpoint treats as a complete checkpoint of ``step``."""
    ck = run_dir / "checkpoints" / f"step_{step:08d}"
    ck.mkdir(parents=True, exist_ok=True)
    (ck / "megaloop.json").write_text(json.dumps({"step": step, "complete": True}))
    (ck / ".metadata").write_text("")
    (ck / "common.pt").write_text("")
    (run_dir / "checkpoints" / "latest").write_text(ck.name)


def fake_metrics(run_dir: Path, steps: int, *, prior: bool = True) -> None:
    rows = []
    for s in range(1, steps + 1):
        r = {"step": s, "loss": 8.0 - s, "model_flops": 1e9, "model_flops_total": 1e9 * s, "step_time_s": 0.5}
        if prior:
            r.update(prior_probs=[0.1, 0.2, 0.3, 0.2, 0.2], prior_mean_depth=3.2, prior_entropy=1.5)
        if s == steps:
            r["val_ce"] = 6.5
        rows.append(json.dumps(r))
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("\n".join(rows) + "\n")
