"""megaloop/sweep.py, the launcher of LR screens and reproductions: exit rules, the local thread
budget, and launcher errors (the launches themselves: test_lr_screen*.py, tests/repro)."""

from __future__ import annotations

import argparse
import re

import pytest

from megaloop.errors import UserError
from megaloop.runtime.exits import EXIT_REQUEUE
from megaloop.sweep import add_launch_args, launch_from_args, stopped


def _launch(*argv: str, default_parallel: int | None = None):
    p = argparse.ArgumentParser()
    add_launch_args(p, default_parallel="-")
    return launch_from_args(p.parse_args(list(argv)), default_parallel)


def test_stopped_runs_are_resumed_not_failed() -> None:
    # the trainer's requeue exit, or SIGINT / SIGTERM / SIGKILL seen by Popen (-N) or a shell (128+N)
    for code in (EXIT_REQUEUE, -2, -15, -9, 130, 143, 137):
        assert stopped(code), code
    for code in (None, 0, 1, 2, 3, -11, 139):
        assert not stopped(code), code


def test_thread_budget_is_split_among_runs() -> None:
    a = _launch("--threads", "8")  # default: one thread per run, as many runs as threads
    assert (a.parallel, a.threads) == (8, 1)
    a = _launch("--threads", "8", default_parallel=1)  # the screen's default: one run, all threads
    assert (a.parallel, a.threads) == (1, 8)
    a = _launch("--threads", "8", "--parallel", "2", "--nproc", "2")
    assert (a.parallel, a.threads) == (2, 2)
    a = _launch("--threads", "8", "--threads-per-arm", "4")
    assert (a.parallel, a.threads) == (2, 4)
    a = _launch("--devices", "0,1,2,3", "--nproc", "2")
    assert a.parallel == 2 and a.devices == ["0", "1", "2", "3"]
    a = _launch("--launcher", "slurm", "--parallel", "3")  # the array throttle; no thread split
    assert (a.parallel, a.threads) == (3, None)


@pytest.mark.parametrize("argv, words", [
    (["--parallel", "0"], "--parallel: must be >= 1"),
    (["--threads-per-run", "0"], "--threads-per-run: must be >= 1"),
    (["--nproc", "0"], "--nproc: must be >= 1"),
    (["--devices", "0", "--parallel", "2"], "--devices: 1 device(s) for 2 parallel run(s)"),
])
def test_bad_launch_options(argv: list[str], words: str) -> None:
    with pytest.raises(UserError, match=re.escape(words)):
        _launch(*argv)
