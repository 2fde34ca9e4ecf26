"""A failure on one rank of a job: the survivors' broken collective is one line naming the rank
(megaloop/runtime/parallel.py peer_lost_line), and a save that failed on one rank makes no further
collective (megaloop/train/trainer.py save, run_dir.RunDirLock.check_held): it deadlocked the job."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megaloop.runtime import parallel


def test_a_collective_broken_by_another_ranks_exit_is_one_line(monkeypatch):
    monkeypatch.setattr(parallel.torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(parallel.torch.distributed, "get_rank", lambda: 0)
    monkeypatch.setattr(parallel.torch.distributed, "get_world_size", lambda: 2)
    err = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:7574. This is "
                       "typically caused by a remote worker crashing.\nmore")
    line = parallel.peer_lost_line(err)
    assert line.startswith("megaloop: stopped (rank 0): another rank of the job ended first") and "\n" not in line
    assert "Connection closed by peer" in line and "says why" in line
    assert parallel.peer_lost_line(RuntimeError("shape mismatch")) is None  # a bug keeps its traceback
    # this rank's own broken connections are not another rank's exit (review): their traceback stays
    for own in (BrokenPipeError(32, "Broken pipe"), ConnectionResetError(104, "Connection reset by peer"),
                ConnectionError("('Connection aborted.', ConnectionResetError(104, 'Connection reset by peer'))")):
        assert parallel.peer_lost_line(own) is None, own
    monkeypatch.setattr(parallel.torch.distributed, "get_world_size", lambda: 1)  # train's one-process group
    assert parallel.peer_lost_line(err) is None
    monkeypatch.setattr(parallel.torch.distributed, "is_initialized", lambda: False)
    assert parallel.peer_lost_line(err) is None


def test_a_failed_save_makes_no_collective(tmp_path, monkeypatch):
    """ENOSPC raised on rank 1 before megatron's first collective: rank 1's handler checked the lock
    with an all_reduce while rank 0 waited in megatron's all_gather, and both hung (audit)."""
    from megaloop.train import run_dir
    from megaloop.train.checkpoint import CheckpointSaveError
    from megaloop.train.trainer import Trainer

    lock = run_dir.RunDirLock(tmp_path)
    lock.acquire(rank=0)
    calls = []

    def agree(ok):
        calls.append(ok)
        return ok

    monkeypatch.setattr(run_dir, "_agree", agree)

    def failing_save(*_a, **_k):
        raise CheckpointSaveError("checkpoint step 4 could not be written: no space left on device (ENOSPC)")

    fake = SimpleNamespace(_lock=lock, step=4, model=None, optimizer=None, _common=lambda before: {},
                           ckpt=SimpleNamespace(save=failing_save))
    with pytest.raises(CheckpointSaveError, match="ENOSPC"):
        Trainer.save(fake)
    assert calls == [True]  # the check before the save only: none after the failure
    lock.release()
