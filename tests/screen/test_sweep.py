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
    # the other launcher's options were accepted and ignored
    (["--sbatch-arg=--partition=gpu"], "--sbatch-arg: applies to --launcher slurm only"),
    (["--wait"], "--wait: applies to --launcher slurm only"),
    (["--poll", "5"], "--poll: applies to --launcher slurm only"),
    (["--launcher", "slurm", "--threads", "4"], "--threads: applies to --launcher local only"),
    (["--launcher", "slurm", "--threads-per-run", "2"], "--threads-per-run: applies to --launcher local only"),
    (["--launcher", "slurm", "--devices", "0,1"], "--devices: applies to --launcher local only"),
    (["--launcher", "slurm", "--poll", "5"], "--poll: goes with --wait"),
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


def test_runs_start_in_the_callers_directory(tmp_path, monkeypatch) -> None:
    """Relative paths in a sweep's overrides (data.path=mds, a screen set, a config YAML) are checked in
    the caller's directory before the launch; the runs start there too (they started in the repository,
    where every run failed on the path its checks had accepted), locally and under slurm (--chdir)."""
    import sys

    from megaloop.sweep import LocalPool, Sweep, sbatch_command

    monkeypatch.chdir(tmp_path)
    sweep = Sweep(out=tmp_path / "out", runs=[], tag="t")
    sweep.out.mkdir()
    pool = LocalPool(sweep, _launch())
    log = tmp_path / "log.txt"
    assert pool._spawn(0, [sys.executable, "-c", "import os; print('CWD', os.getcwd())"], log) == 0
    assert f"CWD {tmp_path}" in log.read_text()
    assert f"--chdir={tmp_path}" in sbatch_command(sweep, [0], _launch())


def test_a_run_started_as_the_stop_comes_is_asked_to_stop(tmp_path, monkeypatch) -> None:
    """A SIGTERM / Ctrl-C that lands after a worker checked the stop flag but before it registered the
    process it was starting saw no process ("asking 0 run(s)"), and that run trained to the end. The
    signal is made to land exactly there: the Popen below sends it and waits for the launcher's
    "asking N run(s)" line before starting the (long) process."""
    import os
    import signal
    import subprocess
    import sys
    import threading
    import time

    import megaloop.sweep as sweep_mod
    from megaloop.sweep import LocalPool, Run, Sweep

    monkeypatch.setattr(sweep_mod, "STOP_TIMEOUT_S", 5)  # the old code waited this long, then killed it
    asked = threading.Event()
    lines: list[str] = []

    class Logged(Sweep):
        def log(self, msg: str) -> None:
            lines.append(msg)
            if "asking" in msg:
                asked.set()

    real_popen = subprocess.Popen

    def popen_as_the_signal_comes(argv, **kw):  # noqa: ANN001, ANN003
        os.kill(os.getpid(), signal.SIGTERM)  # the launcher's handler runs in the main thread
        assert asked.wait(10)
        return real_popen([sys.executable, "-c", "import time; time.sleep(60)"], **kw)

    monkeypatch.setattr(sweep_mod.subprocess, "Popen", popen_as_the_signal_comes)
    sweep = Logged(out=tmp_path / "out", runs=[], tag="t")
    sweep.out.mkdir()
    run = Run(name="a", run_dir=tmp_path / "out" / "a", config="tiny", overrides=[])
    codes: list[int] = []
    pool = LocalPool(sweep, _launch(), on_exit=lambda r, code: codes.append(code))
    t0 = time.time()
    with pytest.raises(KeyboardInterrupt):
        pool.run([run])
    assert codes == [-signal.SIGTERM], (codes, lines)  # asked to checkpoint, not killed after the wait
    assert time.time() - t0 < 5, lines
    assert any("asking 0 run(s)" in m for m in lines) and any("started as the stop came" in m for m in lines)


def test_the_sweep_commands_start_without_torch() -> None:
    """lr-screen / reproduce are drivers (login nodes, --help, --dry-run, --collect): their modules and the
    folder checks they share with the post-training commands must not import torch (found: the folder
    guard's import of megaloop.post loaded it, ~1 s)."""
    import subprocess
    import sys

    code = ("import sys, megaloop.screen.cli, megaloop.repro.cli, megaloop.post.runs; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('megaloop'))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
