"""RL update cost: endpoint reuse (Neumann-(b−1)) vs full BPTT vs recompute, at R = 5 and 32.

One update = the policy-gradient surrogate's forward + backward on a batch of sequences (GRPO-style
loss: random group advantages times the completion tokens' log-probs, completions = the second
half of each sequence). Reported per arm and depth: median / min wall time over ``--repeats``
runs (after one warm-up), bytes autograd saves for backward (each storage once, parameters
excluded; via ``torch.autograd.graph.saved_tensors_hooks``) and, on CUDA, the peak allocator
memory. Reuse starts from the endpoint a rollout would have saved (computed beforehand, untimed).
Usage:
    python tools/bench/bench_rl_reuse.py [--hidden 256 --seq 128 --batch 2 --b 5 --depths 5 32 --threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import (check_model_args, command, export_model, export_model_args, model_args, positive_int, sync,
                    write_result)
from common import check_results_dir

from megaloop.post.rl.parts import HFLoopedParts
from megaloop.post.rl.reuse import SavedTensorMeter, bptt_backward, endpoint, recompute_backward, reuse_backward


def main():
    p = argparse.ArgumentParser()
    model_args(p, seq=128, batch=2)
    p.add_argument("--b", type=positive_int, default=5, help="Neumann terms (b=5: Neumann-4)")
    p.add_argument("--depths", type=positive_int, nargs="+", default=[5, 32])
    p.add_argument("--repeats", type=positive_int, default=5)
    export_model_args(p, "rl_reuse")
    args = p.parse_args()
    check_results_dir()
    check_model_args(p, args)
    model, device = export_model(args)
    cfg = model.config
    parts = HFLoopedParts(model)
    params = parts.parameters()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(device)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    half = args.seq // 2
    adv = torch.randn(args.batch, generator=gen).to(device)

    def loss_fn(logits):
        lp = torch.log_softmax(logits[:, half:].float(), -1).gather(-1, targets[:, half:, None]).squeeze(-1)
        return -(adv[:, None] * lp).mean()

    runs = {}
    for depth in args.depths:
        z_end = endpoint(parts, inputs, depth)
        runs[("reuse", depth)] = (lambda z=z_end: reuse_backward(parts, inputs, z, loss_fn, args.b))
        runs[("recompute", depth)] = (lambda d=depth: recompute_backward(parts, inputs, d, loss_fn, args.b))
        runs[("bptt", depth)] = (lambda d=depth: bptt_backward(parts, inputs, d, loss_fn))
    times: dict = {k: [] for k in runs}
    mem: dict = {}
    for rep in range(args.repeats + 1):  # depths and arms interleaved; the first round is a warm-up
        for key, run in runs.items():
            model.zero_grad(set_to_none=True)
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() if device == "cuda" else 0
            sync()
            t0 = time.perf_counter()
            with SavedTensorMeter(exclude=params) as meter:
                run()
            sync()
            dt = time.perf_counter() - t0
            if rep:
                times[key].append(dt)
            mem[key] = {"saved_bytes": meter.bytes,
                        "cuda_peak_bytes": (torch.cuda.max_memory_allocated() - base) if device == "cuda" else None}
    results = []
    for (arm, depth) in runs:
        rec = {"arm": arm, "depth": depth, "b": args.b if arm != "bptt" else depth,
               "median_s": statistics.median(times[(arm, depth)]), "min_s": min(times[(arm, depth)]),
               **mem[(arm, depth)]}
        results.append(rec)
        print(f"R={depth:3d} {arm:10s} median {rec['median_s']*1e3:8.1f} ms  min {rec['min_s']*1e3:8.1f} ms  "
              f"saved {rec['saved_bytes']/2**20:8.1f} MiB", flush=True)
    get = {(r["arm"], r["depth"]): r for r in results}
    d0, d1 = args.depths[0], args.depths[-1]
    summary = {
        f"reuse_time_ratio_R{d1}_over_R{d0}": get[("reuse", d1)]["median_s"] / get[("reuse", d0)]["median_s"],
        f"reuse_min_time_ratio_R{d1}_over_R{d0}": get[("reuse", d1)]["min_s"] / get[("reuse", d0)]["min_s"],
        f"reuse_saved_ratio_R{d1}_over_R{d0}": get[("reuse", d1)]["saved_bytes"] / get[("reuse", d0)]["saved_bytes"],
        f"bptt_saved_ratio_R{d1}_over_R{d0}": get[("bptt", d1)]["saved_bytes"] / get[("bptt", d0)]["saved_bytes"],
        f"bptt_time_ratio_R{d1}_over_R{d0}": get[("bptt", d1)]["median_s"] / get[("bptt", d0)]["median_s"],
    }
    for d in args.depths:
        summary[f"speedup_reuse_over_bptt_R{d}"] = get[("bptt", d)]["median_s"] / get[("reuse", d)]["median_s"]
        summary[f"speedup_recompute_over_bptt_R{d}"] = get[("bptt", d)]["median_s"] / get[("recompute", d)]["median_s"]
        summary[f"saved_bytes_bptt_over_reuse_R{d}"] = get[("bptt", d)]["saved_bytes"] / get[("reuse", d)]["saved_bytes"]
    for k, v in summary.items():
        print(f"{k}: {v:.3f}")
    config = {**vars(args), "device": device, "n_prelude": cfg.n_prelude, "n_core": cfg.n_core, "n_coda": cfg.n_coda,
              "intermediate_size": cfg.intermediate_size, "loss": "GRPO surrogate on the second half of each sequence"}
    write_result(args.name, config, {"runs": results, "summary": summary},
                 command("bench_rl_reuse.py", args))


if __name__ == "__main__":
    main()
