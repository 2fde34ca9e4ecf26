"""Fixtures of the post-training tests (``tiny_teacher`` lives in tests/conftest.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT, clean_env


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """``(run_dir, hf_dir)``: a tiny native megaloop run (BPE tokenizer, ``checkpoints/step_00000003``)
    and the same model converted to an HF folder, written by ``tests/post/native_checkpoint.py`` in
    its own process (so megatron-core never starts in the pytest process)."""
    base = tmp_path_factory.mktemp("native")
    run, hf = base / "run", base / "hf"
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "post" / "native_checkpoint.py"), str(run), str(hf)],
                          cwd=ROOT, env={**clean_env(), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        pytest.fail(f"native_checkpoint.py failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return run, hf
