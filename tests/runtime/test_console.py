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
