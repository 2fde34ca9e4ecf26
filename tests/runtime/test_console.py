"""A closed stdout pipe: the command goes on with its console off (it used to fail with exit 1)."""

from __future__ import annotations

import subprocess

from tests.train.helpers import env, metrics, train_cmd
from tests.conftest import ROOT


def test_training_goes_on_when_the_reader_of_stdout_exits(tmp_path):
    """`megaloop train ... | head -1`: BrokenPipeError at the next print was a traceback, exit 1 and
    no checkpoint (audit K). Now every step trains and the run ends with 0 and its final checkpoint."""
    log = tmp_path / "stderr.txt"
    with open(log, "wb") as errf:  # a file, not a pipe: stderr's warnings cannot fill a pipe nobody reads
        proc = subprocess.Popen(train_cmd(tmp_path / "run", "train.max_steps=4", "train.save_interval=0",
                                          "train.log_interval=1"),
                                cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=errf)
        proc.stdout.readline()  # as `head -1`: one line read, then the pipe is closed
        proc.stdout.close()
        code = proc.wait(timeout=600)
    err = log.read_text()
    assert code == 0, err[-3000:]
    assert "Traceback" not in err and "standard output was closed" in err, err[-3000:]
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1, 2, 3, 4]
    assert (tmp_path / "run" / "checkpoints" / "step_00000004").is_dir()


def test_the_wrapper_points_stdout_at_devnull_once(tmp_path):
    import io
    import os

    from megaloop.runtime.console import PipeSafeStdout

    r, w = os.pipe()
    stream = io.TextIOWrapper(os.fdopen(w, "wb", buffering=0), write_through=True)
    safe = PipeSafeStdout(stream)
    safe.write("one\n")
    assert os.read(r, 100) == b"one\n"
    os.close(r)
    safe.write("two\n")  # EPIPE (SIGPIPE is ignored in Python)
    assert safe.lost
    safe.write("three\n")
    safe.flush()
    assert os.readlink(f"/proc/self/fd/{stream.fileno()}") == os.devnull
    stream.close()


def test_a_stop_after_both_streams_closed_still_exits_with_its_status(tmp_path):
    """`2>&1 | head -1`: stdout and stderr are one closed pipe; a Ctrl-C then checkpoints and exits 130
    (its one-line message on stderr would raise BrokenPipeError)."""
    import os
    import signal
    import time

    r, w = os.pipe()
    run = tmp_path / "run"
    proc = subprocess.Popen(train_cmd(run, "train.max_steps=40", "train.save_interval=0", "train.log_interval=1"),
                            cwd=ROOT, env=env(), stdout=w, stderr=w)
    os.close(w)
    os.read(r, 1)  # as `head -c1`: the reader then goes away
    os.close(r)
    log = run / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and (not log.exists() or len(log.read_text().splitlines()) < 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)  # Ctrl-C: checkpoint, "interrupted" on stderr, 130
    assert proc.wait(timeout=300) == 130
    step = metrics(run)[-1]["step"]
    assert (run / "checkpoints" / f"step_{step:08d}").is_dir()
