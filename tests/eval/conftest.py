"""A tiny looped model trained for 30 steps (``megaloop train --config tiny``), once per session.

Set ``MEGALOOP_TEST_TRAINED_RUN=DIR`` to reuse an existing run directory instead (local iteration).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT


@pytest.fixture(autouse=True)
def _one_thread(one_thread):  # every evaluation test (tests/conftest.py)
    yield


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory) -> Path:
    reuse = os.environ.get("MEGALOOP_TEST_TRAINED_RUN")
    if reuse and (Path(reuse) / "checkpoints").is_dir():
        return Path(reuse)
    run = tmp_path_factory.mktemp("tiny30") / "run"
    dist_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in dist_vars}  # this process's world may be up
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", WANDB_MODE="offline")
    cmd = [sys.executable, "-m", "megaloop.cli", "train", "--config", "tiny", "--run-dir", str(run),
           "train.max_steps=30"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"tiny training failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    assert (run / "checkpoints").is_dir()
    return run


@pytest.fixture(scope="session")
def trained_engine(megatron_world, trained_run):
    from megaloop.inference.engine import InferenceEngine

    return InferenceEngine.from_checkpoint(trained_run)


@pytest.fixture(scope="session")
def val_data(trained_engine):
    from megaloop.eval.ppl import load_eval_data

    return load_eval_data("default", default_seq_len=trained_engine.max_context, max_seqs=8,
                          vocab_size=trained_engine.vocab_size)


@pytest.fixture
def cli(megatron_world, monkeypatch, capsys):
    """``run(*argv) -> (exit code, the one 'megaloop: error' line, or all of stderr)`` of the
    ``megaloop`` CLI in this process (tests/eval/test_cli.py has its own, returning stdout too)."""
    import megaloop.runtime.parallel as parallel
    from megaloop.cli import main

    monkeypatch.setattr(parallel, "destroy_distributed", lambda: None)  # keep the session's world

    def run(*argv: str) -> tuple[int, str]:
        with pytest.raises(SystemExit) as exit_info:
            main(list(argv))
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("megaloop: error")]
        return exit_info.value.code, (lines[0] if len(lines) == 1 else err)

    return run
