#!/usr/bin/env python
"""Benchmark the megaloop train loader: steady-state tokens/s after warm-up.

    python tools/bench/bench_loader.py [--seconds 5] [--synthetic-sequences 8192] [--seq-len 2048]

Datasets: the embedded default (seq_len 256) and a larger synthetic MDS set (zstd shards of
random tokens, written once into the cache). For each dataset and DataLoader worker count the
loader is built, ``--warmup`` batches are drawn (first-batch latency reported separately: it
includes copying/decompressing shards into the cache slot), then batches are drawn for
``--seconds``; tokens/s = batches x micro_batch_size x seq_len / elapsed. Epoch boundaries inside
the window are included (they restart DataLoader workers), so this is a true steady state.
Writes ``tools/bench/results/loader.json`` through ``common.write_result``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from common import command, int_list, nonnegative_int, positive_float, positive_int, user_errors, write_result
from common import check_results_dir


def bench_one(path: str, seq_len: int, mbs: int, workers: int, warmup: int, seconds: float,
              cache_dir: str) -> dict:
    """Time one loader configuration; returns throughput and latency figures."""
    from megaloop.data import DataConfig, build_train_loader

    t0 = time.perf_counter()
    loader = build_train_loader(DataConfig(path=path, num_workers=workers, cache_dir=cache_dir),
                                seq_len=seq_len, micro_batch_size=mbs, dp_rank=0, dp_size=1,
                                seed=0)
    t_build = time.perf_counter() - t0
    it = iter(loader)
    next(it)
    t_first = time.perf_counter() - t0
    for _ in range(warmup):
        next(it)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        batch = next(it)
        n += 1
    elapsed = time.perf_counter() - start
    assert batch["tokens"].shape == (mbs, seq_len)
    loader.close()
    tokens = n * mbs * seq_len
    return {"num_workers": workers, "micro_batch_size": mbs, "seq_len": seq_len,
            "build_s": round(t_build, 3), "first_batch_s": round(t_first, 3), "batches": n,
            "seconds": round(elapsed, 3), "tokens_per_s": round(tokens / elapsed),
            "batches_per_s": round(n / elapsed, 1), "epochs_crossed": loader.epoch}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=positive_float, default=5.0, help="measurement window per case")
    p.add_argument("--warmup", type=nonnegative_int, default=10, help="batches drawn before timing")
    p.add_argument("--workers", type=int_list(0), default="0,2", help="DataLoader worker counts to try")
    p.add_argument("--default-seq-len", type=positive_int, default=256)
    p.add_argument("--default-mbs", type=positive_int, default=8)
    p.add_argument("--synthetic-sequences", type=positive_int, default=8192)
    p.add_argument("--seq-len", type=positive_int, default=2048, help="synthetic set sequence length")
    p.add_argument("--mbs", type=positive_int, default=8, help="synthetic set micro-batch size")
    p.add_argument("--cache-dir", default=None, help="default: $MEGALOOP_CACHE or ~/.cache/megaloop")
    args = p.parse_args(argv)
    check_results_dir()
    if args.synthetic_sequences < args.mbs:
        p.error(f"--synthetic-sequences {args.synthetic_sequences}: fewer than one micro-batch (--mbs {args.mbs})")

    import numpy

    from megaloop.data import ensure_default_dataset  # first: makes `import streaming` work
    import streaming
    from megaloop.data.streaming import default_cache_dir
    from megaloop.data.synthetic import write_synthetic_mds

    load_before = [round(x, 2) for x in os.getloadavg()]
    cache = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    workers = [int(w) for w in args.workers.split(",")]
    with user_errors(p):  # what the data code refuses (e.g. a dataset too small for a micro-batch): one line
        t0 = time.perf_counter()
        default_root = ensure_default_dataset(cache_dir=cache, seq_len=args.default_seq_len)
        t_default = time.perf_counter() - t0
        synth = cache / f"bench-synthetic-{args.synthetic_sequences}x{args.seq_len}"
        t0 = time.perf_counter()
        synth_man = write_synthetic_mds(synth, args.synthetic_sequences, args.seq_len,
                                        vocab_size=32768, seed=0)
        t_synth = time.perf_counter() - t0
        results = []
        cases = [("default", str(default_root / "train"), args.default_seq_len, args.default_mbs),
                 ("synthetic", str(synth), args.seq_len, args.mbs)]
        for name, path, seq_len, mbs in cases:
            for w in workers:
                r = bench_one(path, seq_len, mbs, w, args.warmup, args.seconds, str(cache))
                r["dataset"] = name
                results.append(r)
                print(json.dumps(r), flush=True)
    datasets = {
        "default": {"build_or_load_s": round(t_default, 3),
                    **{k: json.loads((default_root / "train" / "manifest.json").read_text())[k]
                       for k in ("num_sequences", "total_tokens", "seq_len", "vocab_size")}},
        "synthetic": {"write_or_load_s": round(t_synth, 3),
                      **{k: synth_man[k] for k in ("num_sequences", "total_tokens", "seq_len",
                                                   "vocab_size", "compression")}},
    }
    config = {k: v for k, v in vars(args).items() if k != "cache_dir"}
    config.update(datasets=datasets, streaming=streaming.__version__, numpy=numpy.__version__,
                  loadavg_1_5_15min_before_after=[load_before, [round(x, 2) for x in os.getloadavg()]])
    write_result("loader", config, results, command("bench_loader.py", argparse.Namespace(**{
        k: v for k, v in vars(args).items() if k != "cache_dir"})))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
