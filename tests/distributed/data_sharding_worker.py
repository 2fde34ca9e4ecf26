"""torchrun worker: data sharding by data-parallel rank under TP (no megatron needed).

    torchrun --nproc_per_node 4 tests/distributed/data_sharding_worker.py --data DIR --tp 2 --out R.json

Global rank r has tp_rank = r % tp and dp_rank = r // tp (megatron's TP-fastest order). Every rank
reads one epoch of its DP shard; rank 0 checks that the TP ranks of a replica saw identical
batches, that replicas are disjoint, and that their union is the whole dataset, and writes the
evidence to ``--out``. Exit status 0 only if every check passed.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import sys

import torch
import torch.distributed as dist


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    env_before = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                  "LOCAL_WORLD_SIZE")}
    from megaloop.data import DataConfig, build_train_loader
    from megaloop.data.synthetic import decode_ids

    dp_size, dp_rank = world // args.tp, rank // args.tp
    loader = build_train_loader(DataConfig(path=args.data, num_workers=args.workers),
                                seq_len=args.seq_len, micro_batch_size=args.micro_batch_size,
                                dp_rank=dp_rank, dp_size=dp_size, seed=3)
    batches = list(itertools.islice(iter(loader), loader.batches_per_epoch))
    ids = [decode_ids(b["tokens"].numpy(), args.vocab_size).tolist() for b in batches]
    digests = [hashlib.sha1(b["tokens"].numpy().tobytes() + b["labels"].numpy().tobytes()
                            + b["loss_mask"].numpy().tobytes()).hexdigest() for b in batches]
    mine = {"rank": rank, "dp_rank": dp_rank, "ids": ids, "digests": digests,
            "state": loader.state_dict(), "num_samples": loader.num_samples,
            "env_unchanged": env_before == {k: os.environ.get(k) for k in env_before}}
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    ok = torch.tensor([1])
    if rank == 0:
        replicas: dict[int, list] = {}
        for r in everyone:
            replicas.setdefault(r["dp_rank"], []).append(r)
        tp_identical = all(all(m["digests"] == g[0]["digests"] and m["ids"] == g[0]["ids"]
                               for m in g) for g in replicas.values())
        sets = {d: {i for b in g[0]["ids"] for i in b} for d, g in replicas.items()}
        flat = [i for g in replicas.values() for b in g[0]["ids"] for i in b]
        disjoint = len(flat) == len(set(flat))
        union_complete = sorted(flat) == list(range(everyone[0]["num_samples"]))
        same_state = all(r["state"] == everyone[0]["state"] for r in everyone)
        env_ok = all(r["env_unchanged"] for r in everyone)
        result = {"world": world, "tp": args.tp, "dp": dp_size, "tp_identical": tp_identical,
                  "replicas_disjoint": disjoint, "union_is_dataset": union_complete,
                  "state_identical": same_state, "env_unchanged": env_ok,
                  "samples_per_replica": {str(d): len(s) for d, s in sets.items()},
                  "batches_per_rank": len(everyone[0]["ids"])}
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        ok[0] = int(tp_identical and disjoint and union_complete and same_state and env_ok)
    dist.broadcast(ok, 0)
    loader.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok.item() else 1


if __name__ == "__main__":
    sys.exit(main())
