"""Training-step throughput per FLOP: megaloop's LoopedGPT (megatron-core layers; the local spec on
CPU, Transformer Engine on GPU) vs a plain-PyTorch looped model of the same shape and weights.

The plain model is megaloop's own Hugging Face export class (``MegaloopForCausalLM``: nn.Linear,
``F.scaled_dot_product_attention``, a Python loop over recurrences), i.e. the style of the public
looped-LM research codebases. Both arms run the same depth R with full backpropagation through
all R recurrences (identical model FLOPs), so the step-time ratio is the throughput-per-FLOP ratio.
Arms are alternated; medians are compared. Usage:
    python tools/bench/bench_vs_plain_pytorch.py [--hidden 256 --heads 4 --seq 256 --batch 4 --depth 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch
from common import (command, model_args, native_model, parse_megatron_bench, positive_int, timed, user_errors,
                    write_result)


def main() -> None:
    p = argparse.ArgumentParser()
    model_args(p, seq=256, batch=4)
    p.add_argument("--depth", type=positive_int, default=5)
    p.add_argument("--reps", type=positive_int, default=8)
    args, dev, dtype = parse_megatron_bench(p)
    from megaloop.hf.convert import hf_config_from_native, native_to_hf_state_dict
    from megaloop.hf.modeling_megaloop import MegaloopForCausalLM
    from megaloop.model.config import ModelConfig
    from megaloop.train.flops import microbatch_flops

    with user_errors(p):  # what ModelConfig refuses of the shape: one line, exit 2
        cfg = ModelConfig(hidden_size=args.hidden, num_heads=args.heads, seq_len=args.seq, bf16=args.bf16,
                          injection="parcae_nonorm", bptt_window=args.depth)
    native = native_model(cfg, args.vocab)
    # the plain model's weights: the native model's (local-spec names); with TE layers (GPU), the same
    # seeded initialisation built once more with the local spec
    cpu_ref = native
    if native._te:
        ref_cfg = dataclasses.replace(cfg, transformer_impl="local")
        cpu_ref = native_model(ref_cfg, args.vocab)
    hf_cfg = hf_config_from_native(cfg, vocab_size=native.vocab_size, num_recurrences=args.depth)
    plain = MegaloopForCausalLM(hf_cfg)
    missing, unexpected = plain.load_state_dict(native_to_hf_state_dict(cpu_ref.state_dict(), cfg), strict=False)
    assert not unexpected and all("inv_freq" in k or "rotary" in k for k in missing), (missing, unexpected)
    del cpu_ref
    native = native.to(dev, dtype).train()
    plain = plain.to(dev, dtype).train()
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=dev,
                        generator=torch.Generator(device=dev).manual_seed(0))

    def step_native():
        native(ids, labels=ids, depth=args.depth, bptt_window=args.depth, noise_seed=0).mean().backward()
        native.zero_grad(set_to_none=True)

    def step_plain():
        plain(input_ids=ids, labels=ids, use_cache=False, num_recurrences=args.depth).loss.backward()
        plain.zero_grad(set_to_none=True)

    arms = {"megaloop": step_native, "plain_pytorch": step_plain}
    for fn in arms.values():  # warm-up
        fn()
    times = {k: [] for k in arms}
    for _ in range(args.reps):
        for k, fn in arms.items():
            times[k].append(timed(fn))
    med = {k: statistics.median(v) for k, v in times.items()}
    flops = microbatch_flops(cfg, native.vocab_size, args.seq, args.batch * args.seq, args.depth, args.depth)
    res = {"median_step_s": med, "model_flops_per_step": flops,
           "model_tflops": {k: flops / v / 1e12 for k, v in med.items()},
           "ratio_megaloop_over_plain_step_time": med["megaloop"] / med["plain_pytorch"],
           "params": sum(p.numel() for p in native.parameters())}
    print(res)
    write_result("vs_plain_pytorch" + ("_gpu" if dev == "cuda" else ""), {**vars(args), "device": dev}, res,
                 command("bench_vs_plain_pytorch.py", args))


if __name__ == "__main__":
    main()
