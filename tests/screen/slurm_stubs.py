"""The stub sbatch / squeue of tests/slurm/stubs.py for sweep launches (megaloop/sweep.py; the
stub sbatch records the SWEEP_* variables)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.slurm.stubs import stub_env


def sweep_stubs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, job_id: str) -> Path:
    """Stubs first on PATH, no real SLURM_* variables."""
    env = stub_env(tmp_path, STUB_JOB_ID=job_id)
    for k in list(os.environ):
        if k.startswith("SLURM_"):
            monkeypatch.delenv(k)
    for k in ("PATH", "STUB_LOG", "STUB_DIR", "STUB_JOB_ID"):
        monkeypatch.setenv(k, env[k])
    return tmp_path
