"""Data loader throughput next to training consumption on the `tiny` config (one run).

Loader: tokens/s of the tiny config's train loader (embedded corpus, its seq_len and micro-batch,
0 workers). Training: median tokens/s of `megaloop train --config tiny` over steps 3..N (the first
steps include start-up). The ratio says how much head-room the loader has. Usage:
    python tools/bench/bench_loader_vs_train.py [--steps 12]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import ROOT, int_at_least, positive_float, write_result  # noqa: I001  (sets sys.path first)
from common import check_results_dir
from bench_loader import bench_one


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int_at_least(12), default=12,
                   help="training steps (the median skips the first 2; at least 12: the tiny preset warms up for "
                        "10 steps and its WSD decay must not overlap the warm-up)")
    p.add_argument("--seconds", type=positive_float, default=5.0)
    args = p.parse_args()
    check_results_dir()
    from megaloop.config import load_config

    cfg = load_config("tiny")
    cache = os.environ.get("MEGALOOP_CACHE")
    loader = bench_one("default", cfg.model.seq_len, cfg.train.micro_batch_size, 0, 10, args.seconds, cache)
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([sys.executable, "-m", "megaloop.cli", "train", "--config", "tiny", "--run-dir", d,
                        f"train.max_steps={args.steps}", "train.save_interval=0", "logging.progress=false"],
                       cwd=ROOT, check=True, capture_output=True, env={**os.environ, "WANDB_MODE": "disabled"})
        rows = [json.loads(x) for x in Path(d, "metrics.jsonl").read_text().splitlines()]
    train_tps = statistics.median(r["tokens_per_s"] for r in rows[2:])
    res = {"loader_tokens_per_s": loader["tokens_per_s"], "train_tokens_per_s": train_tps,
           "loader_over_train": loader["tokens_per_s"] / train_tps, "loader": loader}
    print({k: v for k, v in res.items() if k != "loader"})
    write_result("loader_vs_train", vars(args), res,
                 f"python tools/bench/bench_loader_vs_train.py --steps {args.steps} --seconds {args.seconds}")


if __name__ == "__main__":
    main()
