"""Run `megaloop train` in subprocesses and read what it logged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import ROOT, clean_env

SMALL = ["train.global_batch_size=8", "train.micro_batch_size=4", "optim.warmup_steps=1",
         "depth.warmup_updates=0", "train.eval_batches=1", "logging.progress=false"]


def train_cmd(run_dir: Path, *overrides: str, nproc: int = 1, resume: str | None = None) -> list[str]:
    base = ["-m", "megaloop.cli", "train", "--config", "tiny", "--run-dir", str(run_dir)]
    if resume:
        base += ["--resume", resume]
    if nproc == 1:
        return [sys.executable, *base, *SMALL, *overrides]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", *base[1:], *SMALL, *overrides]


def env() -> dict:
    return {**clean_env(), "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PYTHONWARNINGS": "ignore"}


def run_train(run_dir: Path, *overrides: str, nproc: int = 1, resume: str | None = None,
              expect: int = 0, timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(train_cmd(run_dir, *overrides, nproc=nproc, resume=resume), cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != expect:
        out = "\n".join(l for l in (proc.stdout + proc.stderr).splitlines() if "warn" not in l.lower())
        raise AssertionError(f"exit {proc.returncode} (expected {expect}):\n{out[-5000:]}")
    return proc


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]


def signal_after(run_dir: Path, sig: int, *overrides: str, lines: int = 3,
                 group: bool = False) -> tuple[int, str, str]:
    """Start a run, send ``sig`` once ``lines`` steps are logged (``group``: to its whole process group, as
    torchrun, slurm or ``kill -- -PGID`` do); (exit code, stdout, stderr)."""
    proc = subprocess.Popen(train_cmd(run_dir, *overrides), cwd=ROOT, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=group)
    log = run_dir / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and (not log.exists() or len(log.read_text().splitlines()) < lines):
        time.sleep(0.2)
    if group:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err
