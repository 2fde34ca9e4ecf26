"""A checkpoint save that fails on one rank of two (torchrun, gloo): every rank must raise
CheckpointSaveError promptly, rank 0 naming the OS error and the other rank pointing at rank 0,
and the folder must hold only the earlier checkpoint. Two cases in one launch: DP=2 with rank 0
failing (it writes the replicated shards), TP=2 with rank 1 failing (its own shards).
Usage: ``ckpt_fault_worker.py ROOT``."""

from __future__ import annotations

import errno
import os
import sys
import time
from pathlib import Path

from common import init_world, set_layout  # noqa: E402 - sets sys.path


def case(root: Path, rank: int, tp: int, failing: int) -> None:
    import torch
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megaloop.model.build import build_model
    from megaloop.model.config import ModelConfig
    from megaloop.train.checkpoint import CheckpointManager, CheckpointSaveError

    set_layout(tp=tp)
    cfg = ModelConfig(hidden_size=32, num_heads=2, seq_len=8, vocab_size=64)
    chunks = build_model(cfg, vocab_size=64, tp=tp, pp=1, vpp=None, sequence_parallel=False, seed=1, ddp=False)[0]
    ckpt = CheckpointManager(root)
    ckpt.save(1, chunks, None, common={"step": 1})
    real = filesystem_async._write_item
    if rank == failing:
        def write(*a, **k):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(root / ".tmp_step_00000002" / "x.distcp"))
        filesystem_async._write_item = write
    t0 = time.time()
    try:
        ckpt.save(2, chunks, None, common={"step": 2})
        print(f"tp{tp} rank {rank}: NOT RAISED", flush=True)
    except CheckpointSaveError as err:
        print(f"tp{tp} rank {rank}: raised in {time.time() - t0:.1f}s: {err}", flush=True)
    filesystem_async._write_item = real
    torch.distributed.barrier()  # both ranks are still in step: nobody hangs in the save's collectives
    if rank == 0:
        print(f"tp{tp} names: {sorted(p.name for p in root.iterdir())}", flush=True)


def main() -> None:
    root = Path(sys.argv[1])
    rank, _ = init_world()
    case(root / "dp2", rank, tp=1, failing=0)
    case(root / "tp2", rank, tp=2, failing=1)
    if rank == 0:
        print("ALL DONE", flush=True)


if __name__ == "__main__":
    main()
