"""megaloop/runtime/orphan_guard.py: a sweep's local run (own session) gets SIGTERM when its launcher
dies, even of a SIGKILL (it trained on as an orphan after `kill -9` of `megaloop lr-screen`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import ROOT, clean_env


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in state  # a zombie nobody reaped yet is dead


def test_the_run_gets_sigterm_when_the_launcher_is_killed(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    launcher = tmp_path / "launcher.py"
    launcher.write_text(
        "import os, subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-m', 'megaloop.runtime.orphan_guard', str(os.getpid()), '--',\n"
        "                      sys.executable, '-c', 'import time; time.sleep(300)'], start_new_session=True)\n"
        f"open({str(pidfile)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(300)\n")
    env = {**clean_env(), "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, str(launcher)], env=env)
    try:
        deadline = time.time() + 60
        while not pidfile.is_file() and time.time() < deadline:
            time.sleep(0.1)
        child = int(pidfile.read_text())
        time.sleep(1.0)  # the guard has exec'd the command (same pid)
        assert _alive(child)
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        assert b"time.sleep(300)" in cmdline and b"orphan_guard" not in cmdline
        proc.kill()
        proc.wait()
        deadline = time.time() + 30
        while _alive(child) and time.time() < deadline:
            time.sleep(0.1)
        assert not _alive(child), "the run outlived its launcher"
    finally:
        proc.kill()
        if pidfile.is_file() and _alive(int(pidfile.read_text())):
            os.kill(int(pidfile.read_text()), 9)


def test_usage_error() -> None:
    from megaloop.runtime.orphan_guard import main

    assert main(["x", "--", "true"]) == 2 and main([]) == 2


def test_torchrun_ranks_stop_when_torchrun_is_killed(tmp_path: Path) -> None:
    """torchrun starts each rank in a session of its own: `kill -9` of the command's process group killed
    torchrun alone and the ranks trained on as orphans (rl, distill-prefill, train). Each rank now gets
    SIGTERM when torchrun dies: it checkpoints and stops."""
    import signal

    from tests.train.helpers import env, train_cmd

    run = tmp_path / "run"
    cmd = train_cmd(run, "train.max_steps=400", "train.save_interval=0", nproc=2)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    log = run / "metrics.jsonl"
    try:
        deadline = time.time() + 300
        while (not log.is_file() or len(log.read_text().splitlines()) < 2) and time.time() < deadline:
            assert proc.poll() is None
            time.sleep(0.2)
        ranks = [int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
        assert len(ranks) == 2, ranks
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun's group: the ranks are in their own sessions
        proc.wait(timeout=30)
        deadline = time.time() + 120
        while any(_alive(r) for r in ranks) and time.time() < deadline:
            time.sleep(0.2)
        assert not any(_alive(r) for r in ranks), "the ranks trained on after torchrun was killed"
        steps = len(log.read_text().splitlines())
        assert steps < 400 and (run / "checkpoints" / f"step_{steps:08d}" / "megaloop.json").is_file()
    finally:
        for r in locals().get("ranks", []):
            if _alive(r):
                os.kill(r, signal.SIGKILL)
