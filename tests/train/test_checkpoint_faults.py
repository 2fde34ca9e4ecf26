"""Checkpoints under faults: a group-wide SIGTERM after the first save, a save the disk refuses,
run directories whose checkpoints are incomplete, a lagging ``latest`` pointer, a superseded
checkpoint as --resume, and another run's checkpoint resumed over an aborted run's metrics."""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from megaloop.train.checkpoint import CheckpointError, CheckpointManager, CheckpointSaveError
from megaloop.train.run_dir import RunDirError, check_fresh_start, check_resume_source, set_aside_newer
from tests.conftest import ROOT
from tests.train.helpers import env, metrics, run_train, train_cmd


def _snapshot(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*"))
            if p.is_file() and p.name != ".megaloop.lock"}


def _fake_checkpoint(root: Path, step: int, complete: bool = True) -> Path:
    """A ``step_*`` directory with the files :func:`is_complete` looks for (``megaloop.json`` only
    when ``complete``)."""
    d = root / f"step_{step:08d}"
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(b"m")
    (d / "common.pt").write_bytes(b"c")
    if complete:
        (d / "megaloop.json").write_text(json.dumps({"step": step}))
    return d


# ---------------------------------------------------------------- 1: group signals
def test_a_save_starts_no_manager_process(megatron_world, tmp_path):
    """megatron's writer would spawn a persistent multiprocessing.Manager at the first save; a
    SIGTERM to the process group killed it and the next (stop) save failed with BrokenPipeError."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from tests.train.test_checkpoint import _chunks

    CheckpointManager(tmp_path).save(1, _chunks(), None, common={"step": 1})
    assert filesystem_async._results_queue is None
    assert not [p for p in multiprocessing.active_children() if "Manager" in p.name]


def test_group_sigterm_after_the_first_save_checkpoints_and_resumes(tmp_path):
    """SIGTERM to the whole process group (torchrun, slurm, `timeout`, `kill -- -PGID`) after the
    first save: the stop checkpoint is written and complete, exit 75, and the run resumes from it to
    the end. Also: a copy whose checkpoints were all made incomplete is refused in one line, untouched."""
    run = tmp_path / "run"
    args = ("train.max_steps=8", "train.save_interval=2")
    proc = subprocess.Popen(train_cmd(run, *args), cwd=ROOT, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    first = run / "checkpoints" / "step_00000002" / "megaloop.json"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not (
            first.is_file() and len((run / "metrics.jsonl").read_text().splitlines()) >= 3):
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, (out + err)[-4000:]
    assert "BrokenPipeError" not in err
    ck = run / "checkpoints"
    stop = ck / (ck / "latest").read_text().strip()
    assert 3 <= int(stop.name.split("_")[1]) < 8 and (stop / "megaloop.json").is_file()
    assert not list(ck.glob(".tmp_step_*"))

    # fault 2: every step_* incomplete (a partial copy): --resume auto and a fresh start refuse, one line
    bad = tmp_path / "bad"
    shutil.copytree(run, bad)
    for meta in (bad / "checkpoints").glob("step_*/megaloop.json"):
        meta.unlink()
    before = _snapshot(bad)
    for resume in ("auto", None):
        p = run_train(bad, *args, resume=resume, expect=2)
        lines = [line for line in p.stderr.splitlines() if line.strip() and "warn" not in line.lower()]
        assert len(lines) == 1 and "only incomplete checkpoints" in lines[0] and "step_00000002" in lines[0], lines
        assert _snapshot(bad) == before

    p = run_train(run, *args, resume="auto")
    assert f"resumed from {stop}" in p.stdout
    assert [r["step"] for r in metrics(run)] == list(range(1, 9))


# ---------------------------------------------------------------- 3: a save the disk refuses
@pytest.mark.parametrize("failure", ["enospc", "zip_writer_full", "mkdir_denied"])
def test_a_failed_save_leaves_nothing_behind_and_says_why(megatron_world, tmp_path, monkeypatch, failure):
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megaloop.train import ckpt_io
    from tests.train.test_checkpoint import _chunks

    ckpt = CheckpointManager(tmp_path)
    chunks = _chunks()
    ckpt.save(1, chunks, None, common={"step": 1})
    before = _snapshot(tmp_path)
    if failure == "enospc":  # in megatron's (forked) writer processes
        def write(*a, **k):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / ".tmp_step_00000002" / "x.distcp"))
        monkeypatch.setattr(filesystem_async, "_write_item", write)
        want = "no space left on device (ENOSPC"
    elif failure == "zip_writer_full":  # what torch's zip writer says on a full disk: no errno
        def write(*a, **k):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        monkeypatch.setattr(filesystem_async, "_write_item", write)
        monkeypatch.setattr(ckpt_io, "_free_bytes", lambda where: 0)
        want = "no space left on device (0.0 MiB free"
    else:
        real = Path.mkdir

        def mkdir(self, *a, **k):
            if self.name.startswith(".tmp_step_"):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
            return real(self, *a, **k)
        monkeypatch.setattr(Path, "mkdir", mkdir)
        want = "permission denied (EACCES"
    with pytest.raises(CheckpointSaveError) as info:
        ckpt.save(2, chunks, None, common={"step": 2})
    msg = str(info.value)
    assert "\n" not in msg and str(tmp_path) in msg and want in msg and "newest step_00000001" in msg, msg
    assert msg.endswith("then continue with --resume auto")
    assert _snapshot(tmp_path) == before  # no .tmp_step_*, step 1 and latest as they were
    if failure == "mkdir_denied":  # convert --from-hf saves through the manager too: its advice is its own
        with pytest.raises(CheckpointSaveError, match=r"fix the folder, then run the same command again$"):
            CheckpointManager(tmp_path, retry="then run the same command again").save(2, chunks, None,
                                                                                        common={"step": 2})
    monkeypatch.undo()
    assert ckpt.save(2, chunks, None, common={"step": 2}).name == "step_00000002"  # and it works again


def test_a_failed_save_for_another_reason_keeps_its_traceback(megatron_world, tmp_path, monkeypatch):
    from megaloop.train import checkpoint
    from tests.train.test_checkpoint import _chunks

    def save(sd, path):
        raise ValueError("a bug")
    monkeypatch.setattr(checkpoint.dist_checkpointing, "save", save)
    with pytest.raises(ValueError, match="a bug"):
        CheckpointManager(tmp_path).save(1, _chunks(), None, common={"step": 1})
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------- 2: only incomplete checkpoints
def test_only_incomplete_checkpoints_are_refused_naming_them(tmp_path):
    root = tmp_path / "checkpoints"
    for s in (2, 4):
        _fake_checkpoint(root, s, complete=False)
    ckpt = CheckpointManager(root)
    for call in (lambda: ckpt.resolve("auto"), lambda: check_fresh_start(ckpt, tmp_path),
                 lambda: check_resume_source(ckpt, tmp_path, _fake_checkpoint(tmp_path / "other", 4))):
        with pytest.raises(CheckpointError, match="only incomplete checkpoints .step_00000002, step_00000004: "
                                                  "missing megaloop.json"):
            call()
    _fake_checkpoint(root, 1)  # a complete one: --resume auto takes it (the newer incomplete ones set aside)
    assert ckpt.resolve("auto").name == "step_00000001"
    assert not (root / "superseded").exists()


# ---------------------------------------------------------------- 4: a lagging `latest`
def test_latest_is_the_newest_complete_checkpoint_whatever_the_pointer_says(tmp_path):
    root = tmp_path / "checkpoints"
    _fake_checkpoint(root, 6)
    newest = _fake_checkpoint(root, 8)
    (root / "latest").write_text("step_00000006")  # killed between the rename and the pointer write
    ckpt = CheckpointManager(root)
    assert ckpt.latest() == newest and ckpt.resolve("auto") == newest
    assert set_aside_newer(ckpt, newest) == []
    assert (root / "latest").read_text() == "step_00000008" and newest.is_dir()


def test_a_resave_cut_between_its_renames_is_finished_when_the_next_run_takes_the_lock(tmp_path, capsys):
    """_publish re-saving step N renames step_N to .old_step_N, then .tmp_step_N to step_N; a kill between
    the two left no step_N: the resume went back to an older step, the next save deleted the new copy and
    .old_step_N stayed for good. The next run holding the lock publishes the new copy (else puts the
    old one back) and drops an .old_step_N whose step_N exists."""
    from megaloop.train.run_dir import RunDirLock, finish_interrupted_publish

    root = tmp_path / "checkpoints"
    _fake_checkpoint(root, 2)
    for step, new in ((4, True), (6, False)):  # the new copy complete / never written
        os.rename(_fake_checkpoint(root, step), root / f".old_step_{step:08d}")
        if new:
            (_fake_checkpoint(root, 40) / "megaloop.json").write_text(json.dumps({"step": 4, "new": True}))
            os.rename(root / "step_00000040", root / f".tmp_step_{step:08d}")
    _fake_checkpoint(root, 8)
    (root / ".old_step_00000008").mkdir()  # killed after the publish, before the old copy's removal
    _fake_checkpoint(root, 10, complete=False)  # an incomplete step_N (a partial copy) keeps its .old_step_N
    os.rename(_fake_checkpoint(root, 12), root / ".old_step_00000010")
    ckpt = CheckpointManager(root)
    assert ckpt.latest().name == "step_00000008" and len(ckpt.complete_checkpoints()) == 2
    lock = RunDirLock(tmp_path)
    lock.acquire(0, held=lambda: finish_interrupted_publish(ckpt))
    lock.release()
    assert [p.name for p in ckpt.complete_checkpoints()] == ["step_00000002", "step_00000004", "step_00000006",
                                                           "step_00000008"]
    assert json.loads((root / "step_00000004" / "megaloop.json").read_text()) == {"step": 4, "new": True}
    assert json.loads((root / "step_00000006" / "megaloop.json").read_text()) == {"step": 6}
    assert [p.name for p in root.glob(".old_step_*")] == [".old_step_00000010"]
    assert not list(root.glob(".tmp_step_*"))
    out = capsys.readouterr().out
    assert "warning: " in out and ".old_step_00000010 kept: " in out and "step_00000010 is incomplete" in out, out
    assert "step_00000004: a save of it was cut short between its renames; its new copy is" in out, out
    assert "step_00000006: a save of it was cut short between its renames; the copy it replaced is" in out, out
    assert "step_00000008" not in out


def test_a_resave_cut_between_its_renames_resumes_from_that_step(tmp_path):
    """The trainer repairs the cut re-save before it looks for the checkpoint: --resume auto goes on
    from step 4 (it went back to step 2 and redid steps 3-4)."""
    run_train(tmp_path, "train.max_steps=4", "train.save_interval=2")
    root = tmp_path / "checkpoints"
    shutil.copytree(root / "step_00000004", root / ".tmp_step_00000004")
    os.rename(root / "step_00000004", root / ".old_step_00000004")
    before = metrics(tmp_path)
    proc = run_train(tmp_path, "train.max_steps=5", "train.save_interval=2", resume="auto")
    assert "step_00000004: a save of it was cut short between its renames; its new copy is" in proc.stdout
    assert "resumed" in proc.stdout and [r["step"] for r in metrics(tmp_path)] == [1, 2, 3, 4, 5]
    assert metrics(tmp_path)[:4] == before
    assert not list(root.glob(".old_step_*")) and not list(root.glob(".tmp_step_*"))


# ---------------------------------------------------------------- 5: a superseded checkpoint
def test_resuming_an_own_superseded_checkpoint_is_refused_with_the_true_reason(tmp_path):
    root = tmp_path / "checkpoints"
    _fake_checkpoint(root, 4)
    old = _fake_checkpoint(root / "superseded", 8)
    with pytest.raises(RunDirError) as info:
        check_resume_source(CheckpointManager(root), tmp_path, old)
    msg = str(info.value)
    assert "set aside in" in msg and "new --run-dir" in msg and "not a checkpoint of" not in msg, msg


# ---------------------------------------------------------------- 6: metrics of another history
def test_resuming_another_runs_checkpoint_sets_the_old_metrics_aside(tmp_path, capsys):
    run, other = tmp_path / "run", tmp_path / "other"
    run.mkdir()
    rows = "".join(json.dumps({"step": s, "loss": 9.0}) + "\n" for s in (1, 2, 3))
    (run / "metrics.jsonl").write_text(rows)
    assert set_aside_newer(CheckpointManager(run / "checkpoints"), _fake_checkpoint(other / "checkpoints", 4)) == []
    aside = list(run.glob("metrics.jsonl.*"))
    assert not (run / "metrics.jsonl").exists() and len(aside) == 1 and aside[0].read_text() == rows
    assert aside[0].name in capsys.readouterr().out
    # the run's own checkpoint: its metrics stay (MetricsLogger truncates them after the step)
    (run / "metrics.jsonl").write_text(rows)
    set_aside_newer(CheckpointManager(run / "checkpoints"), _fake_checkpoint(run / "checkpoints", 2))
    assert (run / "metrics.jsonl").read_text() == rows


@pytest.mark.distributed
def test_a_save_that_fails_on_one_rank_fails_on_every_rank(tmp_path):
    """ENOSPC in one rank's writer (DP=2: rank 0; TP=2: rank 1, which writes its own shards): both
    ranks raise CheckpointSaveError within seconds (no rank waits in a collective), rank 0 names
    the error, the other rank points at rank 0, and only the earlier checkpoint is left."""
    from tests.conftest import run_torchrun

    out = run_torchrun(ROOT / "tests/distributed/ckpt_fault_worker.py", 2, str(tmp_path), timeout=240)
    assert "ALL DONE" in out and "NOT RAISED" not in out, out[-3000:]
    for tp in (1, 2):
        # found anywhere in a line: the two ranks share torchrun's pipe, so another rank's unfinished
        # line can be glued in front of one (the same reason as tests.conftest.tagged_json)
        found = {r: re.search(rf"tp{tp} rank {r}: raised in [^\n]*", out) for r in (0, 1)}
        assert all(found.values()), out[-3000:]
        lines = {r: m.group(0) for r, m in found.items()}
        assert all(float(l.split(" in ")[1].split("s:")[0]) < 30 for l in lines.values()), lines
        assert "no space left on device (ENOSPC" in lines[0], lines[0]
        assert "the error is named on rank 0" in lines[1] and "newest step_00000001" in lines[1], lines[1]
        assert f"tp{tp} names: ['latest', 'step_00000001']" in out


# ---------------------------------------------------------------- 7: kills and full disks around the saves
def _logger(run: Path, start_step: int):
    from megaloop.config import LoggingConfig
    from megaloop.train.metrics import MetricsLogger

    return MetricsLogger(run, LoggingConfig(wandb="disabled", progress=False), enabled=True, total_steps=9,
                         start_step=start_step, config_dict={})


def test_resume_rewrites_the_metrics_log_whole_and_only_when_a_line_goes(tmp_path):
    """Every resume rewrote metrics.jsonl in place (truncate, then write): a kill during it left the whole
    history at 0 bytes. Now untouched when nothing goes; otherwise a new file renamed over the old one."""
    log = tmp_path / "metrics.jsonl"
    rows = "".join(json.dumps({"step": s, "loss": 9.0}) + "\n" for s in (1, 2, 3))
    log.write_text(rows)
    before = log.stat()
    _logger(tmp_path, 3).close()
    after = log.stat()
    assert log.read_text() == rows and (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    log.write_text(rows + json.dumps({"step": 4, "loss": 9.0}) + "\n" + '{"step": 5, "lo')  # a kill mid-line
    ino = log.stat().st_ino
    _logger(tmp_path, 3).close()
    assert log.read_text() == rows and log.stat().st_ino != ino
    assert not [p for p in tmp_path.iterdir() if p.name != "metrics.jsonl"]


def test_a_metrics_line_the_disk_refuses_stops_in_one_line_without_a_torn_line(tmp_path, monkeypatch):
    """A disk filling between saves: chained tracebacks and a metrics.jsonl ending mid-record."""
    from megaloop.train import metrics as metrics_mod

    logger = _logger(tmp_path, 0)
    logger.log({"step": 1, "loss": 9.0})
    good = (tmp_path / "metrics.jsonl").read_bytes()
    real = os.write

    def short_then_full(fd, data):
        if len(data) > 10:
            return real(fd, data[:10])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(metrics_mod.os, "write", short_then_full)
    with pytest.raises(metrics_mod.MetricsWriteError) as info:
        logger.log({"step": 2, "loss": 8.0})
    msg = str(info.value)
    assert "\n" not in msg and "step 2 could not be logged (no space left on device (ENOSPC))" in msg, msg
    monkeypatch.undo()
    logger.close()
    assert (tmp_path / "metrics.jsonl").read_bytes() == good


def test_resume_on_a_read_only_checkpoints_folder_does_not_fail_on_latest(tmp_path, monkeypatch, capsys):
    """Every resume rewrote `latest` (informative only) and a read-only or full disk raised a traceback."""
    from megaloop.runtime import files

    root = tmp_path / "checkpoints"
    _fake_checkpoint(root, 2)
    newest = _fake_checkpoint(root, 4)
    (root / "latest").write_text(newest.name)
    calls = []

    def refuse(path, text):
        calls.append(path)
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
    monkeypatch.setattr(files, "atomic_write_text", refuse)
    assert set_aside_newer(CheckpointManager(root), newest) == [] and calls == []  # unchanged: not rewritten
    (root / "latest").write_text("step_00000002")  # lagging after a kill
    assert set_aside_newer(CheckpointManager(root), newest) == [] and len(calls) == 1
    assert "could not be updated to step_00000004 (read-only file system (EROFS" in capsys.readouterr().out


def test_pruning_renames_before_deleting_and_clears_what_a_kill_left(tmp_path, monkeypatch):
    """A kill while an old checkpoint was deleted left a half-deleted step_* (sometimes still holding
    megaloop.json, so it counted as complete) that no later save removed."""
    root = tmp_path / "checkpoints"
    half = _fake_checkpoint(root, 1, complete=False)  # a deletion interrupted before this release
    for s in (2, 3, 4):
        _fake_checkpoint(root, s)
    leftover = root / ".pruned_step_00000000"
    leftover.mkdir()
    (leftover / "common.pt").write_bytes(b"c")
    ckpt = CheckpointManager(root, keep=2)
    seen = []

    def interrupted(path, *a, **k):  # the kill lands during the deletion of step 2
        seen.append(Path(path).name)
        raise KeyboardInterrupt
    monkeypatch.setattr(shutil, "rmtree", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ckpt._prune(4)
    monkeypatch.undo()
    assert len(seen) == 1 and seen[0].startswith(".pruned_step_"), seen
    assert [p.name for p in ckpt.all_step_dirs()] == ["step_00000003", "step_00000004"]  # renamed away first
    (root / ".latest.k2x9.tmp").write_text("step_0000")  # a kill inside the atomic write of `latest`
    for torn in (".tmp_step_00000003", ".tmp_step_00000005"):  # saves a SIGKILL cut short (audit K)
        (root / torn).mkdir()
        (root / torn / "common.pt").write_bytes(b"half")
    ckpt._prune(4)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000003", "step_00000004"] and not half.exists()


def test_a_zip_write_failure_names_a_file_size_limit(tmp_path, monkeypatch):
    """`ulimit -f`: torch's writer fails with no errno, on a filesystem with space left; name the limit."""
    import resource

    from megaloop.train import ckpt_io

    err = RuntimeError("Worker failure: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    monkeypatch.setattr(ckpt_io, "_free_bytes", lambda where: 2**40)
    monkeypatch.setattr(resource, "getrlimit", lambda what: (8000 * 1024, resource.RLIM_INFINITY))
    msg = ckpt_io.explain_save_failure(err, tmp_path)
    assert "the write failed:" in msg and "file-size limit, `ulimit -f`, is 7.8 MiB" in msg, msg
    monkeypatch.undo()
    if resource.getrlimit(resource.RLIMIT_FSIZE)[0] == resource.RLIM_INFINITY:
        assert "a disk quota reads this way too" in ckpt_io.explain_save_failure(err, tmp_path)
    other = RuntimeError("Worker failure: KeyError: 'exp_avg'")  # not the zip writer's: no hint (review)
    want = "the write failed: RuntimeError: Worker failure: KeyError: 'exp_avg'"
    assert ckpt_io.explain_save_failure(other, tmp_path) == want


def test_a_never_stepped_fused_adam_under_the_distributed_optimizer_is_refused_in_one_line():
    """Transformer Engine's FusedAdam (the GPU default) creates its state at its first update; megatron's
    distributed optimizer then fails on the missing moments (review: KeyError 'exp_avg'). One line instead,
    before anything is written; a stepped one, and torch's Adam (filled with its zero state), pass."""
    import torch

    from megaloop.train.checkpoint import _refuse_unstepped_fused

    p = torch.nn.Parameter(torch.zeros(3))

    class FusedAdam:  # the shape of TE's: state filled lazily by step()
        def __init__(self):
            self.state, self.param_groups = {}, [{"params": [p]}]

    class DistributedOptimizer:
        def __init__(self, inner):
            self.optimizer = inner

    fused = FusedAdam()
    with pytest.raises(CheckpointSaveError, match=r"^checkpoint step 0: no update has been applied yet .*FusedAdam"):
        _refuse_unstepped_fused(DistributedOptimizer(fused), 0)
    fused.state[p] = {"exp_avg": torch.zeros(3)}
    _refuse_unstepped_fused(DistributedOptimizer(fused), 1)
    _refuse_unstepped_fused(DistributedOptimizer(torch.optim.AdamW([p])), 0)
