"""Loop overhead: one training step (forward + backward) of the looped model at R=5 vs megatron
``GPTModel`` with 12 layers of the same width (the same unrolled compute: 1 + 2·5 + 1 layers).

A/B/C are alternated inside one run and the median of each is compared. Usage:
    python tools/bench/bench_loop_overhead.py [--hidden 256 --seq 256 --batch 4 --reps 10]
On a GPU the same script runs in bf16-free FP32 unless --bf16 is given.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from common import (command, model_args, native_model, parse_megatron_bench, positive_int, timed, user_errors,
                    write_result)


def main():
    p = argparse.ArgumentParser()
    model_args(p, seq=256, batch=4)
    p.add_argument("--reps", type=positive_int, default=10)
    args, dev, dtype = parse_megatron_bench(p)
    from megatron.core.models.gpt import GPTModel

    from megaloop.model.config import ModelConfig
    from megaloop.model.specs import layer_spec, transformer_config
    from megaloop.runtime.cpu_compat import without_redirect

    common = dict(hidden_size=args.hidden, num_heads=args.heads, seq_len=args.seq, bf16=args.bf16)
    with user_errors(p):  # what ModelConfig refuses of the shape: one line, exit 2
        looped_cfg = ModelConfig(**common, injection="parcae_nonorm", bptt_window=64)
        gpt_cfg = ModelConfig(**common, arch="untied", num_layers=12)
    looped = native_model(looped_cfg, args.vocab).to(dev, dtype)
    gtc = transformer_config(gpt_cfg, tp=1, pp=1, vpp=None, sequence_parallel=False)
    spec = layer_spec(gpt_cfg)  # the looped model's layers: TE on GPU, local + SDPA attention on CPU
    gpt = GPTModel(config=gtc, transformer_layer_spec=spec, vocab_size=looped.vocab_size,
                   max_sequence_length=args.seq, position_embedding_type="rope",
                   share_embeddings_and_output_weights=False).to(dev, dtype)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=dev)
    pos = torch.arange(args.seq, device=dev).unsqueeze(0).expand_as(ids)

    def step_looped(window):
        def run():
            looped(ids, labels=ids, depth=5, bptt_window=window, noise_seed=0).mean().backward()
            looped.zero_grad(set_to_none=True)
        return run

    def step_gpt():  # like LoopedGPT.forward, outside the CPU layer's redirect mode (no-op on GPU)
        with without_redirect():
            loss = gpt(ids, pos, None, labels=ids).mean()
        loss.backward()
        gpt.zero_grad(set_to_none=True)

    arms = {"gpt12": step_gpt, "looped_r5_b5": step_looped(5), "looped_r5_b2": step_looped(2)}
    for fn in arms.values():  # warm-up
        fn()
    times = {k: [] for k in arms}
    for _ in range(args.reps):
        for k, fn in arms.items():
            times[k].append(timed(fn))
    med = {k: statistics.median(v) for k, v in times.items()}
    res = {"median_step_s": med,
           "ratio_looped_b5_over_gpt12": med["looped_r5_b5"] / med["gpt12"],
           "ratio_looped_b2_over_gpt12": med["looped_r5_b2"] / med["gpt12"],
           # per round (the arms alternate), so a result shows its own spread under a drifting load
           "round_step_s": times,
           **{f"round_ratio_{k}_over_gpt12": _spread([a / g for a, g in zip(times[arm], times["gpt12"])])
              for k, arm in (("b5", "looped_r5_b5"), ("b2", "looped_r5_b2"))},
           "params": {"looped": sum(p.numel() for p in looped.parameters()),
                      "gpt12": sum(p.numel() for p in gpt.parameters())}}
    print(res)
    write_result("loop_overhead" + ("_gpu" if dev == "cuda" else ""), {**vars(args), "device": dev}, res,
                 command("bench_loop_overhead.py", args))


def _spread(ratios: list[float]) -> dict:
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


if __name__ == "__main__":
    main()
