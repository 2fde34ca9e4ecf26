"""Overhead of the CPU compatibility layer (megaloop/runtime/cpu_compat.py) on the tiny config.

Its function redirects (``torch.cuda.current_device``, the RNG tracker) are plain calls; what can
cost time is the process-wide ``TorchFunctionMode`` that sees every torch call made under it.
LoopedGPT's forward pops the mode (it passes an explicit causal mask, so it needs no redirect);
megatron's schedules, optimizer and checkpointing keep it. This measures one training step
(forward + backward) of the tiny native model with the forward run under the mode (``_forward``)
vs the shipped path that pops it (``forward``), alternated in one run. Usage: python tools/bench/bench_cpu_compat.py [--reps 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import native_model, positive_int, single_process_megatron, write_result
from common import check_results_dir


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=positive_int, default=20)
    p.add_argument("--batch", type=positive_int, default=8)
    p.add_argument("--depth", type=positive_int, default=3)
    args = p.parse_args()
    check_results_dir()
    if torch.cuda.is_available():
        raise SystemExit("the CPU compatibility layer is only used without CUDA")
    single_process_megatron()
    from megaloop.config import load_config

    cfg = load_config("tiny").model
    model = native_model(cfg, 4096)
    ids = torch.randint(0, 4096, (args.batch, cfg.seq_len))

    def step(fn):
        t = time.perf_counter()
        fn(ids, labels=ids, depth=args.depth, bptt_window=args.depth, noise_seed=0).mean().backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t

    step(model.forward), step(model._forward)  # warm-up
    popped, under = [], []
    for _ in range(args.reps):
        popped.append(step(model.forward))
        under.append(step(model._forward))
    res = {"median_step_s_forward_without_mode": statistics.median(popped),
           "median_step_s_forward_under_mode": statistics.median(under)}
    res["mode_cost_ratio"] = res["median_step_s_forward_under_mode"] / res["median_step_s_forward_without_mode"]
    print(res)
    write_result("cpu_compat_overhead", {**vars(args), "config": "tiny"}, res,
                 f"python tools/bench/bench_cpu_compat.py --reps {args.reps} --batch {args.batch} --depth {args.depth}")


if __name__ == "__main__":
    main()
