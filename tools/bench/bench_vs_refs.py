"""Training-step throughput per FLOP: megaloop vs the public looped-LM training code at the same shape.

Each reference (Huginn ``seal-rg/recurrent-pretraining``, Parcae ``sandyresearch/parcae``) is
imported from a checkout the user passes (``--huginn PATH``, ``--parcae PATH``; never stored in the
project) exactly as the parity harness imports it (``tools/bench/parity_refs.py``: registry config,
shape overridden, Parcae with SwiGLU and value embeddings off). Its megaloop counterpart is the
parity harness's reference-matched config (``huginn_matched`` / ``parcae_matched`` in
``tools/bench/parity.py``) at the same shape, so both arms hold the same parameters and compute the
same model FLOPs (checked: the parameter counts are recorded and a mismatch above 1 % is refused).

One step = forward + backward of one microbatch at a fixed depth R with truncated BPTT through the
last ``--bptt-window`` recurrences (the references take ``num_steps_pair = [R − k, k]``, megaloop
``depth=R, bptt_window=k``), each system through its own loss path; the optimizer update (AdamW
over the same parameter count) is the same work for every arm and is left out, as in
``bench_vs_plain_pytorch.py``. Arms are alternated after a warm-up; medians are compared. Model
FLOPs per step come from ``megaloop.train.flops.microbatch_flops`` of the matched config. Usage:

    python tools/bench/bench_vs_refs.py --huginn PATH/recurrent-pretraining --parcae PATH/parcae \\
        [--hidden 256 --heads 4 --seq 256 --batch 4 --depth 5 --bptt-window 4 --reps 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
from common import (command, model_args, nonnegative_int, parse_megatron_bench, positive_int, result_name, timed,
                    user_errors, write_result)


def _matched_model(name: str, args):
    """The megaloop ``ModelConfig`` of the parity harness's ``<name>_matched`` config at the bench shape."""
    from parity import MEGALOOP_CONFIGS

    from megaloop.config import load_config

    shape = [f"model.hidden_size={args.hidden}", f"model.num_heads={args.heads}", f"model.seq_len={args.seq}",
             f"model.n_prelude={args.layers[0]}", f"model.n_core={args.layers[1]}", f"model.n_coda={args.layers[2]}",
             f"model.bptt_window={args.bptt_window}", f"model.bf16={str(args.bf16).lower()}"]
    if args.ffn is not None:
        shape.append(f"model.ffn_hidden_size={args.ffn}")
    model_only = [o for o in MEGALOOP_CONFIGS[f"{name}_matched"] if o.startswith("model.")]
    return load_config("tiny", model_only + shape).model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_args(p, seq=256, batch=4)
    p.add_argument("--ffn", type=positive_int, default=None, help="MLP width (default: megaloop's for --hidden)")
    p.add_argument("--layers", type=nonnegative_int, nargs=3, default=[1, 2, 1], metavar=("PRELUDE", "CORE", "CODA"))
    p.add_argument("--depth", type=positive_int, default=5, help="recurrences per step (fixed)")
    p.add_argument("--bptt-window", type=int, default=4, help="recurrences that backpropagate (the last k)")
    p.add_argument("--reps", type=positive_int, default=8)
    p.add_argument("--threads", type=positive_int, default=None, help="CPU threads (default: torch's)")
    p.add_argument("--huginn", default=None, metavar="PATH", help="root of a recurrent-pretraining checkout")
    p.add_argument("--parcae", default=None, metavar="PATH", help="root of a parcae checkout")
    p.add_argument("--name", type=result_name, default="vs_refs")
    args, dev, dtype = parse_megatron_bench(p)
    refs = {k: v for k, v in (("huginn", args.huginn), ("parcae", args.parcae)) if v}
    if not refs:
        p.error("pass --huginn PATH and/or --parcae PATH (checkouts of the reference repositories)")
    if not 1 <= args.bptt_window <= args.depth:
        p.error(f"--bptt-window: must be in [1, --depth {args.depth}], got {args.bptt_window}")
    from parity_refs import reference_root

    for name, path in refs.items():
        try:
            reference_root(name, path)
        except SystemExit as err:  # its message names the parity harness's --ref-path
            p.error(str(err).replace("--ref-path", f"--{name}"))
    if args.threads:
        torch.set_num_threads(args.threads)
    from common import native_model
    from parity_refs import Shape, load_reference

    from megaloop.train.flops import microbatch_flops

    R, k, tokens = args.depth, args.bptt_window, args.batch * args.seq
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(dev)
    labels = torch.roll(ids, -1, dims=1)
    arms, flops, params, commits, configs = {}, {}, {}, {}, {}
    for name, path in refs.items():
        with user_errors(p):  # what the matched config refuses of the shape (e.g. --layers 1 0 1): one line
            cfg = _matched_model(name, args)
        native = native_model(cfg, args.vocab).to(dev, dtype).train()
        try:
            ref = load_reference(name, path, Shape.of(cfg, args.vocab, mean_depth=R, bptt_window=k), seed=0)
        except SystemExit as err:  # named as this script's option, exit 2 (it named --ref-path, exit 1)
            p.error(str(err).replace("--ref-path", f"--{name}"))
        ref.model.to(dev, dtype).train()
        n_ml, n_ref = (sum(q.numel() for q in m.parameters()) for m in (native, ref.model))
        if abs(n_ml - n_ref) > 0.01 * n_ref:
            sys.exit(f"{name}: megaloop's {name}_matched holds {n_ml:,} parameters, the reference {n_ref:,}: "
                     "the shapes do not match (check --ffn)")
        pair = torch.tensor([R - k, k])

        def step_native(m=native):
            m(ids, labels=labels, depth=R, bptt_window=k, noise_seed=0).mean().backward()
            m.zero_grad(set_to_none=True)

        def step_ref(m=ref.model, pair=pair):
            m(ids, labels=labels, num_steps_pair=pair)["loss"].backward()
            m.zero_grad(set_to_none=True)

        arms[f"megaloop_{name}_matched"], arms[f"{name}_reference"] = step_native, step_ref
        f = microbatch_flops(cfg, native.vocab_size, args.seq, tokens, R, k)
        flops.update({f"megaloop_{name}_matched": f, f"{name}_reference": f})
        params.update({f"megaloop_{name}_matched": n_ml, f"{name}_reference": n_ref})
        commits[name] = ref.commit
        configs[name] = f"megaloop {name}_matched (tools/bench/parity.py) vs {type(ref.model).__module__}." \
                        f"{type(ref.model).__name__}"
    for fn in arms.values():  # warm-up (allocator, first-call dispatch)
        fn()
        fn()
    times = {a: [] for a in arms}
    for _ in range(args.reps):
        for a, fn in arms.items():
            times[a].append(timed(fn))
    med = {a: statistics.median(v) for a, v in times.items()}
    res = {"median_step_s": med, "step_s": times, "model_flops_per_step": flops, "params": params,
           "tokens_per_s": {a: tokens / v for a, v in med.items()},
           "model_tflops": {a: flops[a] / v / 1e12 for a, v in med.items()},
           "ratio_megaloop_over_reference_step_time": {n: med[f"megaloop_{n}_matched"] / med[f"{n}_reference"]
                                                       for n in refs},
           # per round (the arms alternate), then the median: robust to the machine's load drifting
           "ratio_paired_median": {n: statistics.median(a / b for a, b in zip(times[f"megaloop_{n}_matched"],
                                                                             times[f"{n}_reference"])) for n in refs},
           "reference_commits": commits, "arms": configs}
    for a in arms:
        print(f"{a:28s} median {med[a] * 1e3:8.1f} ms  {res['tokens_per_s'][a]:9.0f} tok/s  "
              f"{res['model_tflops'][a]:.4f} model TFLOP/s  {params[a]:,} params")
    for n, r in res["ratio_megaloop_over_reference_step_time"].items():
        print(f"megaloop / {n} step time: {r:.3f}x (median of per-round ratios "
              f"{res['ratio_paired_median'][n]:.3f}x)")
    cfg_rec = {k2: v for k2, v in vars(args).items() if k2 not in ("huginn", "parcae")}
    cfg_rec.update(device=dev, references=sorted(refs), load_avg_1min_at_end=round(os.getloadavg()[0], 2))
    cmd_args = argparse.Namespace(**{k2: ("PATH" if k2 in refs and v else v) for k2, v in vars(args).items()})
    write_result(args.name + ("_gpu" if dev == "cuda" else ""), cfg_rec, res, command("bench_vs_refs.py", cmd_args))


if __name__ == "__main__":
    main()
