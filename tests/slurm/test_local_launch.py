"""launch/train_single_node.sh with the real torchrun (2 gloo ranks): paths relative to the caller's
directory; a SIGTERM to the script's whole process group checkpoints after the current step and
the script exits with the trainer's 75 (torchrun alone would say 1); the run resumes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, clean_env

pytestmark = pytest.mark.distributed
ARGS = ["train.max_steps=8", "train.save_interval=2", "optim.warmup_steps=2", "train.eval_batches=1",
        "train.global_batch_size=8", "train.micro_batch_size=2", "logging.progress=false"]


def _launch(cwd: Path) -> subprocess.Popen:
    env = {**clean_env(), "CONFIG": "tiny", "NPROC": "2", "RUN_DIR": "run", "OMP_NUM_THREADS": "1",
           "WANDB_MODE": "offline", "PYTHONWARNINGS": "ignore", "SHUTDOWN_TIMEOUT": "120"}
    return subprocess.Popen(["bash", str(ROOT / "launch" / "train_single_node.sh"), *ARGS], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _steps(run: Path) -> list[int]:
    log = run / "metrics.jsonl"
    return [json.loads(x)["step"] for x in log.read_text().splitlines() if x.strip()] if log.exists() else []


def _signal_after_step(proc: subprocess.Popen, run: Path, step: int, group: bool) -> str:
    deadline = time.time() + 300
    while (not _steps(run) or _steps(run)[-1] < step) and time.time() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.1)
    if group:
        os.killpg(proc.pid, signal.SIGTERM)  # as `timeout`, a terminal or `kill -- -PGID` signal
    else:
        proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    return out


def test_group_sigterm_checkpoints_and_exits_75_then_resumes(tmp_path: Path) -> None:
    # the whole group (the harder case: the script alone is signalled too when the group is, and it is
    # what reaches torchrun, in its own session, exactly once)
    run = tmp_path / "run"  # RUN_DIR=run from the caller's directory, not the repository's
    proc = _launch(tmp_path)
    out = _signal_after_step(proc, run, 3, group=True)  # after the step-2 save
    assert proc.returncode == 75, out[-4000:]
    stopped = _steps(run)[-1]
    assert 3 <= stopped < 8
    assert (run / "checkpoints" / f"step_{stopped:08d}" / "megaloop.json").is_file(), out[-4000:]
    assert not list((run / "checkpoints").glob(".tmp*")), sorted(p.name for p in (run / "checkpoints").iterdir())
    assert not (ROOT / "run").exists()
    proc = _launch(tmp_path)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    assert _steps(run) == list(range(1, 9))
