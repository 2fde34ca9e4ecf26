"""megaloop/sweep.py, the launcher of LR screens and reproductions: exit rules, the local thread
budget, and launcher errors (the launches themselves: test_lr_screen*.py, tests/repro)."""

from __future__ import annotations

import argparse
import re

import pytest

from megaloop.errors import UserError
from megaloop.runtime.exits import EXIT_REQUEUE
from megaloop.sweep import add_launch_args, launch_from_args, run_cli, stopped


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


@pytest.mark.parametrize("sub, words", [
    ("afile", "--out: {f} exists and is not a directory"),
    ("afile/new/x", "--out: {f}/new/x: {f} is not a directory"),
])
@pytest.mark.parametrize("dry", [[], ["--dry-run"]])
def test_out_that_is_a_file_is_refused_before_the_command(tmp_path, capsys, sub: str, words: str,
                                                          dry: list[str]) -> None:
    # run_cli checks --out for lr-screen and reproduce alike, dry run or not, and leaves the file as it was
    f = tmp_path / "afile"
    f.write_text("kept")
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    add_launch_args(p, default_parallel="-")
    ran = []
    assert run_cli("megaloop x", p, lambda args, extras: ran.append(args) or 0,
                   ["--out", str(tmp_path / sub), *dry]) == 2
    assert capsys.readouterr().err == f"megaloop x: error: {words.format(f=f)}\n"
    assert not ran and f.read_text() == "kept"
    # a new directory (under an existing one) and an existing directory are fine
    for ok in (tmp_path / "new" / "out", tmp_path):
        assert run_cli("megaloop x", p, lambda args, extras: 0, ["--out", str(ok), *dry]) == 0
