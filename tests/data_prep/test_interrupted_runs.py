"""The converter's worker processes end with it (SIGTERM or SIGKILL of the main process alone), without
tracebacks and without keeping ``OUT/.lock``; a second conversion into the same ``--out`` says which
process it waits for. Ctrl-C (SIGINT to the whole process group) stops either tool with its one line:
the workers of both share one initializer (``megaloop.data._fsutil.init_pool_worker``)."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from megaloop.data._fsutil import try_lock_fd
from megaloop.data.mds_convert import ConvertConfig, convert_txt360
from tests.data_prep.conftest import write_text_file

REPO = Path(__file__).resolve().parents[2]
DOC = json.dumps({"text": "The river runs north of the old city and under the golden bridge."}) + "\n"
# a data_prep CLI whose workers announce themselves, then take long over their file: {module}.{attr} is
# the worker function, {script} the tool
# (SIGINT as a terminal delivers it: a shell's background job, e.g. a CI launched with `&`, starts with
# SIGINT ignored, and Python then raises no KeyboardInterrupt)
SLOW_TEMPLATE = r"""
import importlib.util, os, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
import {module} as mod

def slow(task):
    os.write(1, f"worker {{os.getpid()}}\n".encode())  # one write: the two workers' lines never interleave
    time.sleep(120)

mod.{attr} = slow
spec = importlib.util.spec_from_file_location("slow_tool", "data_prep/{script}")
cli = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cli)
sys.exit(cli.main(sys.argv[1:]))
"""
SLOW_CLI = SLOW_TEMPLATE.format(module="megaloop.data.mds_convert", attr="_process_part", script="txt360_to_mds.py")
SLOW_EVAL_CLI = SLOW_TEMPLATE.format(module="megaloop.data.eval_sets", attr="_scan", script="build_eval_sets.py")


def _tree(root: Path) -> Path:
    for name in ("0_2.jsonl", "1_2.jsonl"):
        write_text_file(root / "data" / "web" / "1-1" / name, DOC * 20)
    return root


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def _worker_pids(proc: subprocess.Popen, n: int, timeout: float = 120.0) -> list[int]:
    buf, deadline = b"", time.monotonic() + timeout
    fd = proc.stdout.fileno()
    while buf.count(b"\n") < n and time.monotonic() < deadline and proc.poll() is None:
        if select.select([fd], [], [], 0.5)[0]:
            buf += os.read(fd, 4096)
    pids = [int(line.split()[1]) for line in buf.decode().splitlines() if line.startswith("worker ")]
    assert len(pids) == n, (buf, proc.poll())
    return pids


def _kill_main_process(proc: subprocess.Popen, sig: int, out: Path, tool: str, group: bool = False) -> bytes:
    """Signal ``proc`` (a tool with 2 announced workers) alone, or with ``group`` its whole process
    group as Ctrl-C in a terminal does (``proc`` must lead its own session); its workers must end and
    ``out/.lock`` (where ``out`` is left) be free. Returns its stderr; nothing is left running, also
    when an assertion fails."""
    pids: list[int] = []
    try:
        pids = _worker_pids(proc, 2)
        if group:
            os.killpg(proc.pid, sig)
        else:
            os.kill(proc.pid, sig)
        _, err = proc.communicate(timeout=60)
        deadline = time.monotonic() + 15
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in pids if _alive(p)], f"workers outlived {tool}"
        if out.is_dir():
            fd = try_lock_fd(out / ".lock")
            assert fd is not None, "OUT/.lock is still held"
            os.close(fd)
        return err
    finally:
        for p in [proc.pid, *pids]:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_workers_end_with_the_converter(tmp_path, fixture_tokenizer, sig):
    tree, out = _tree(tmp_path / "tree"), tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_CLI, "--input", str(tree), "--out", str(out),
                             "--tokenizer", str(fixture_tokenizer), "--seq-len", "16", "--workers", "2",
                             "--no-progress"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    err = _kill_main_process(proc, sig, out, "the converter")
    if sig == signal.SIGTERM:
        assert proc.returncode == 143
        assert err.decode().strip() == "terminated: finished parts are kept; rerun the same command to resume"
        assert not (out / ".tmp").exists()
    else:
        assert proc.returncode == -signal.SIGKILL and b"Traceback" not in err


def test_a_second_conversion_into_the_same_out_names_the_holder(tmp_path, fixture_tokenizer, capsys):
    tree, out = _tree(tmp_path / "tree"), tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys\nfrom megaloop.data._fsutil import file_lock\n"
         "with file_lock(sys.argv[1], busy='x'):\n    print('held', flush=True)\n    sys.stdin.read()",
         str(out / ".lock")], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(convert_txt360(ConvertConfig(
        input=tree, out=out, tokenizer=str(fixture_tokenizer), seq_len=16, workers=1, progress=False))))
    try:
        assert holder.stdout.readline() == b"held\n"
        capsys.readouterr()
        worker.start()
        err, deadline = "", time.monotonic() + 60
        while "waiting" not in err and time.monotonic() < deadline and worker.is_alive():
            time.sleep(0.1)
            err += capsys.readouterr().err
        assert err.strip() == (f"note: --out {out} is in use by another conversion (pid {holder.pid} on "
                               f"{socket.gethostname()}); waiting for it to finish (lock {out / '.lock'})")
    finally:
        holder.communicate(b"", timeout=30)  # the holder ends: the conversion goes on
        if worker.is_alive():
            worker.join(timeout=120)
    assert result["num_parts"] == 2 and (out / "manifest.json").is_file()
    assert "waiting" not in capsys.readouterr().err  # said once
    assert (out / ".lock").read_text() == ""  # no stale holder left for the next one to name


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_eval_set_workers_end_with_the_builder(tmp_path, fixture_tokenizer, sig):
    """SIGTERM (slurm, timeout) takes the builder's interrupt path, as the converter's: one line, exit 143
    (it killed the builder at once, without a word, exit -15)."""
    tree, out = _tree(tmp_path / "tree"), tmp_path / "eval"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_EVAL_CLI, "--input", str(tree), "--out", str(out),
                             "--tokenizer", str(fixture_tokenizer), "--workers", "2", "--no-progress"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    err = _kill_main_process(proc, sig, out, "build_eval_sets")
    if sig == signal.SIGTERM:
        assert proc.returncode == 143
        assert err.decode().strip() == "terminated: nothing half-written is published; rerun the same command"
        assert not out.exists()  # the folder this build created is removed again


def _sigterm_when_ready(cmd: list[str]) -> tuple[subprocess.Popen, bytes]:
    """Run ``cmd`` (a tool whose patched step prints ``ready`` and sleeps), SIGTERM it once it is ready;
    (the ended process, its stderr). Nothing is left running, also when an assertion fails."""
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == b"ready\n"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc, err


@pytest.mark.parametrize("phase", ["training", "publishing"])
def test_sigterm_stops_the_tokenizer_trainer_with_one_line(tmp_path, phase):
    """train_tokenizer.py on SIGTERM while it publishes: --out as it was, one line, exit 143 (it died at
    once, exit -15, without removing its temporary folder). While the BPE merges run (Rust, minutes on a
    big corpus, which a Python handler would wait for) it still ends at once; the next run removes the
    temporary folder."""
    tree, out = _tree(tmp_path / "tree"), tmp_path / "tok"
    script = (
        "import importlib.util, os, sys, time\nimport megaloop.data.tokenizer as t\n"
        "def slow(*a, **k):\n    os.write(1, b'ready\\n')\n    time.sleep(120)\n"
        "spec = importlib.util.spec_from_file_location('tt', 'data_prep/train_tokenizer.py')\n"
        "cli = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(cli)\n"
        + ("t.train_bytelevel_bpe = slow\n" if phase == "training" else "cli.publish = slow\n")
        + "sys.exit(cli.main(sys.argv[1:]))")
    argv = ["--input", str(tree), "--out", str(out), "--vocab-size", "300"]
    proc, err = _sigterm_when_ready([sys.executable, "-c", script, *argv])
    assert not out.exists()
    if phase == "publishing":
        assert proc.returncode == 143 and err.decode().strip() == f"terminated: --out {out} is as it was", err
        assert not list(tmp_path.glob(".tok.train_tokenizer-tmp-*"))
    else:
        assert proc.returncode == -signal.SIGTERM and b"Traceback" not in err, err
        done = subprocess.run([sys.executable, "data_prep/train_tokenizer.py", *argv], cwd=REPO,
                              capture_output=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert (out / "tokenizer.json").is_file() and not list(tmp_path.glob(".tok.train_tokenizer-tmp-*"))


@pytest.mark.parametrize("tool", ["txt360_to_mds", "build_eval_sets"])
def test_ctrl_c_stops_the_workers_with_one_line(tmp_path, fixture_tokenizer, tool):
    """SIGINT reaches the tool and its pool workers (one process group): the workers ignore it and
    end when the tool stops the pool, so stderr holds the tool's one line, no worker traceback."""
    tree, out = _tree(tmp_path / "tree"), tmp_path / "out"
    script, extra, line = {
        "txt360_to_mds": (SLOW_CLI, ["--seq-len", "16"],
                          "interrupted: finished parts are kept; rerun the same command to resume"),
        "build_eval_sets": (SLOW_EVAL_CLI, [],
                            "interrupted: nothing half-written is published; rerun the same command"),
    }[tool]
    proc = subprocess.Popen([sys.executable, "-c", script, "--input", str(tree), "--out", str(out),
                             "--tokenizer", str(fixture_tokenizer), *extra, "--workers", "2", "--no-progress"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    err = _kill_main_process(proc, signal.SIGINT, out, tool, group=True)
    assert err.decode().strip() == line
    assert proc.returncode == 130


@pytest.mark.parametrize("tool", ["txt360_to_mds", "build_eval_sets", "train_tokenizer", "make_synth"])
def test_sigterm_before_a_tools_own_interrupt_path_is_one_line(tool):
    """SIGTERM while a tool still parses its arguments or imports (seconds, before its try): a
    KeyboardInterrupt traceback and exit 130; now one line and 143."""
    script = ("import importlib.util, os, sys, time\n"
              f"spec = importlib.util.spec_from_file_location('t', 'data_prep/{tool}.py')\n"
              "cli = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(cli)\n"
              "def slow(argv):\n    os.write(1, b'ready\\n')\n    time.sleep(120)\n"
              "cli.parse_args = slow\nsys.exit(cli.main([]))")
    proc, err = _sigterm_when_ready([sys.executable, "-c", script])
    assert proc.returncode == 143 and err.decode().strip() == f"{tool}: terminated", err
