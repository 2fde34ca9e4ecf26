"""Adaptive per-token depth on terminal KV: quality and speed vs fixed depth, on a trained checkpoint.

For fixed R ∈ --fixed and for adaptive policies (--exits, up to --max-depth), on one run:
* PPL of the second half of --seqs validation sequences, teacher-forced token by token on the
  terminal cache (prefix prefilled at --prefill-depth); fixed R is the adaptive code at ε = 0
  (bit-identical to fixed-depth decoding, tests/inference/test_adaptive.py), so every row is the
  same decode protocol;
* greedy generation of --new tokens for a batch of --prompts: decode tokens/s (fixed: the plain
  decode path; adaptive: masking and compaction of finished rows), mean depth, and agreement of the
  tokens with the fixed R = max-depth generation.
Writes results JSON (tools/bench/results/adaptive_depth.json) and a PNG (PPL vs mean depth). Usage:
    python tools/bench/bench_adaptive_depth.py --checkpoint RUN_DIR [--max-depth 32 --seqs 8]
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from common import (RESULTS, command, int_at_least, int_in_range, int_list, positive_int, timed, user_errors,
                    write_result)
from common import check_results_dir

PROMPTS = ["The", "Once upon a time", "In the beginning", "def main():", "A looped model", "Today we",
           "The results show", "import torch"]


def exit_specs(text: str) -> str:
    """``type=`` of ``--exits``: comma-separated criteria, each checked by the parser the engine uses
    (``ExitPolicy.parse``: name and threshold; the depth bounds are checked after parsing); returns
    the string unchanged."""
    from megaloop.inference.adaptive import ExitPolicy

    for spec in text.split(","):
        try:
            ExitPolicy.parse(spec)
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"{spec!r}: {str(err).removeprefix('exit_criterion: ')}") from None
    return text


def device_name(text: str) -> str:
    """``type=`` of ``--device``: what the engine's loader accepts (auto, cpu, cuda, cuda:N; CUDA present)."""
    from megaloop.config_utils import ConfigError
    from megaloop.hf.load import resolve_device

    try:
        resolve_device(text)
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix(f"--device {text}: ")) from None
    return text


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", required=True, help="native checkpoint (run dir / step dir) or HF folder")
    p.add_argument("--data", default="default", help="validation data (megaloop eval --data)")
    # fixed R runs the adaptive code at ε = 0 (ExitPolicy min_depth 2 <= R)
    p.add_argument("--fixed", type=int_list(2), default="4,8,16,32", help="fixed depths (>= 2)")
    p.add_argument("--exits", type=exit_specs, default="latent:0.03,latent:0.01,kl:1e-3,argmax:3")
    p.add_argument("--max-depth", type=int_at_least(2), default=32)
    p.add_argument("--min-depth", type=int_at_least(2), default=2)
    p.add_argument("--prefill-depth", type=positive_int, default=None, help="default: the run's eval depth")
    p.add_argument("--seqs", type=positive_int, default=8)
    p.add_argument("--seq-len", type=int_at_least(2), default=64)  # its second half is scored
    p.add_argument("--prompts", type=int_in_range(1, len(PROMPTS)), default=4)
    p.add_argument("--new", type=positive_int, default=32)
    p.add_argument("--reps", type=positive_int, default=2)
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--device", type=device_name, default="auto")
    args = p.parse_args()
    check_results_dir()
    if args.max_depth < args.min_depth:
        p.error(f"--max-depth {args.max_depth}: must be >= --min-depth {args.min_depth}")
    if not Path(args.checkpoint).exists():
        p.error(f"--checkpoint {args.checkpoint}: no such checkpoint (a trained run, e.g. the one `megaloop reproduce "
                "--experiment depth --scale tiny --out runs/repro_depth` writes to runs/repro_depth/arms/learned_h0.01)")
    torch.set_num_threads(args.threads)
    from megaloop.eval.ppl import load_eval_data
    from megaloop.inference.adaptive import ExitPolicy
    from megaloop.inference.engine import InferenceEngine

    with user_errors(p):  # a path that is no checkpoint, an unknown --data, ...
        eng = InferenceEngine.load(args.checkpoint, device=args.device, cache_mode="terminal")
        pdepth = args.prefill_depth or eng.depth
        data = load_eval_data(args.data, seq_len=args.seq_len, max_seqs=args.seqs, vocab_size=eng.vocab_size,
                              default_seq_len=eng.config.max_position_embeddings)
    tokens, labels, mask = data.tokens[:args.seqs], data.labels[:args.seqs], data.loss_mask[:args.seqs]
    half = tokens.shape[1] // 2
    prompts = PROMPTS[:args.prompts]

    def ppl(policy):
        eng.depth_log.reset()
        _, logits = eng.score_with_prefix(tokens[:, :half], tokens[:, half:], prefill_depth=pdepth, policy=policy)
        lp = torch.log_softmax(logits[..., :eng.vocab_size], -1)
        nll = -lp.gather(-1, labels[:, half:, None]).squeeze(-1)
        m = mask[:, half:].float()
        return math.exp(float((nll * m).sum() / m.sum())), eng.depth_log.mean

    def gen(**kw):
        outs = []
        t = [timed(lambda: outs.append(eng.generate(prompts, max_new_tokens=args.new, stop_at_eos=False,
                                                    prefill_depth=pdepth, **kw))) for _ in range(args.reps)]
        return outs[-1], outs[-1].stats.generated_tokens / min(t)  # best of --reps

    gen(decode_depth=4)  # warm-up
    fixed = [int(r) for r in args.fixed.split(",")]
    ref_out, _ = gen(decode_depth=args.max_depth)
    ref = [r.token_ids for r in ref_out.results]

    def agree(out):
        same = sum(a == b for r, g in zip(out.results, ref) for a, b in zip(r.token_ids, g))
        return same / sum(len(g) for g in ref)

    rows = []
    for R in fixed:
        q, _ = ppl(ExitPolicy("latent", 0.0, 2, R))
        out, tps = gen(decode_depth=R)
        rows.append({"policy": f"fixed R={R}", "mean_depth_ppl": float(R), "ppl": q, "mean_depth_generate": float(R),
                     "tokens_per_s": tps, "agreement_with_max_depth": agree(out)})
        print(rows[-1])
    for spec in args.exits.split(","):
        pol = ExitPolicy.parse(spec, min_depth=args.min_depth, max_depth=args.max_depth)
        q, depth = ppl(pol)
        row = {"policy": spec, "mean_depth_ppl": depth, "ppl": q}
        for rows_mode in ("mask", "compact"):
            out, tps = gen(exit_criterion=spec, min_depth=args.min_depth, max_depth=args.max_depth,
                           finished_rows=rows_mode)
            s = out.stats
            row[f"tokens_per_s_{rows_mode}"] = tps
            row[f"row_recurrences_{rows_mode}"] = s.row_recurrences
            row["mean_depth_generate"], row["depth_histogram"] = s.mean_depth, s.depth_histogram
            row["agreement_with_max_depth"] = agree(out)
        row["tokens_per_s"] = max(row["tokens_per_s_mask"], row["tokens_per_s_compact"])
        rows.append(row)
        print(row)
    by = {r["policy"]: r for r in rows}
    top = by[f"fixed R={max(fixed)}"]
    best = min((r for r in rows if not r["policy"].startswith("fixed")),
               key=lambda r: (r["ppl"] > top["ppl"] * 1.01, r["mean_depth_ppl"]))
    summary = {"reference": top["policy"], "best_adaptive": best["policy"],
               "best_ppl_over_fixed_max": best["ppl"] / top["ppl"],
               "best_depth_over_fixed_max": best["mean_depth_ppl"] / max(fixed),
               "best_speed_over_fixed_max": best["tokens_per_s"] / top["tokens_per_s"],
               "compact_over_mask_speed": {r["policy"]: r["tokens_per_s_compact"] / r["tokens_per_s_mask"]
                                           for r in rows if "tokens_per_s_mask" in r}}
    print(summary)
    name = "adaptive_depth" + ("_gpu" if eng.device.type == "cuda" else "")
    plot = RESULTS / f"{name}.png"
    plot_quality(rows, plot, f"{data.num_seqs}×{data.seq_len} tokens, terminal KV, prefill P={pdepth}")
    cfg = {**vars(args), "checkpoint": Path(args.checkpoint).name, "prefill_depth": pdepth,
           "device": str(eng.device), "step": eng.source.get("step"), "data_source": data.source}
    write_result(name, cfg, {"rows": rows, "summary": summary, "plot": plot.name},
                 command("bench_adaptive_depth.py", args))


def plot_quality(rows, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    fx = [r for r in rows if r["policy"].startswith("fixed")]
    ax.plot([r["mean_depth_ppl"] for r in fx], [r["ppl"] for r in fx], "o-", label="fixed depth")
    for crit, marker in (("latent", "s"), ("kl", "^"), ("argmax", "D")):
        pts = [r for r in rows if r["policy"].startswith(crit)]
        if pts:
            ax.plot([r["mean_depth_ppl"] for r in pts], [r["ppl"] for r in pts], marker, label=f"adaptive {crit}")
            for r in pts:
                ax.annotate(r["policy"].split(":")[1], (r["mean_depth_ppl"], r["ppl"]), fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("mean recurrences per decoded token")
    ax.set_ylabel("PPL (second half, token-by-token)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
