"""slurm's `scancel --signal=TERM` reaches every process of the job step, wandb's service
(`wandb-core`) included: the trainer's next wandb call raised, and the run ended with exit 1, no
checkpoint and no requeue (audit J). Now wandb is turned off with one line and the stop proceeds."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from tests.conftest import ROOT
from tests.train.helpers import env, metrics, train_cmd


def _descendants(pid: int) -> list[int]:
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            parent[int(d)] = int(stat[stat.rindex(")") + 2:].split()[1])
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def test_a_term_to_every_process_of_the_run_wandb_included_checkpoints_and_requeues(tmp_path):
    e = {**env(), "WANDB_MODE": "offline"}
    run, errf = tmp_path / "run", tmp_path / "stderr.txt"
    with open(errf, "w") as err_out:  # a file: wandb's and the libraries' warnings would fill a pipe
        proc = subprocess.Popen(train_cmd(run, "train.max_steps=40", "train.save_interval=0", "logging.wandb=offline"),
                                cwd=ROOT, env=e, stdout=subprocess.DEVNULL, stderr=err_out, text=True)
    log = run / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and (not log.exists() or len(log.read_text().splitlines()) < 3):
        time.sleep(0.2)
    kids = _descendants(proc.pid)
    names = {Path(f"/proc/{k}/comm").read_text().strip() for k in kids if Path(f"/proc/{k}/comm").exists()}
    assert any("wandb" in n for n in names), names  # the service runs as the trainer's child
    for pid in [proc.pid, *kids]:  # as slurm's step signal: every process, not a process group
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    code = proc.wait(timeout=300)
    err = errf.read_text()
    assert code == 75, err[-3000:]
    assert "Traceback" not in err and "wandb logging is off for the rest of this launch" in err, err[-3000:]
    step = metrics(run)[-1]["step"]
    assert (run / "checkpoints" / f"step_{step:08d}").is_dir()
