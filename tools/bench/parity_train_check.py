"""Training equivalence with Huginn's code (``parity.py --check-training STEPS``).

The forward check (:mod:`parity_transfer`) shows that a matched megaloop model computes the
reference's function. This one shows that megaloop's *trainer* (megatron-core optimizer, gradient
finalisation, clipping, WSD schedule, TBPTT) updates it as the harness's plain-PyTorch loop updates
Huginn's model: both start from megaloop's initial weights (copied into the reference), read the
same batches, run the same fixed depth (``--check-depth`` recurrences, the last ``--bptt-window``
with gradients) from h⁰ = 0, and decay the same parameter set. Every random choice that the two
systems make differently is removed, so the per-step losses must agree up to float rounding, which
grows with the number of steps. Only Huginn is supported: Parcae's trainer draws a depth per
sequence, which megaloop's per-microbatch sampler cannot mirror.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

# Held fixed so that both systems make the same choices (the protocol's other settings apply).
FIXED = ["model.state_init=zero", "depth.kind=fixed"]


def _hf_from_trainer(trainer):
    """The trainer's current weights as a megaloop HF model (FP32), without writing a checkpoint:
    a megatron distributed optimizer cannot save before its first step."""
    from megaloop.hf.convert import hf_config_from_native, native_to_hf_state_dict
    from megaloop.hf.modeling_megaloop import MegaloopForCausalLM
    from megaloop.model.build import unwrap

    if len(trainer.model) != 1:
        raise SystemExit("--check-training: needs one model chunk (PP=1, no virtual pipeline)")
    native = unwrap(trainer.model[0])
    vocab = native.embedding.word_embeddings.weight.shape[0]
    hf = MegaloopForCausalLM(hf_config_from_native(trainer.cfg.model, vocab_size=vocab)).float()
    hf.load_state_dict(native_to_hf_state_dict(native.state_dict(), trainer.cfg.model), strict=True)
    return hf


def check_training(args, make_trainer, overrides: list[str], work: Path) -> dict:
    """Train megaloop (``make_trainer(args, overrides, run_dir)``) and Huginn's model side by side
    for ``args.check_training`` steps. Returns the per-step losses, their differences and the
    gradient norms before clipping ([steps] lists)."""
    from parity_refs import Shape, load_reference, make_optimizer, train_step, wsd_lr
    from parity_transfer import transfer

    depth, window = args.check_depth, args.bptt_window
    fixed = FIXED + [f"depth.depth={depth}"]
    steps = args.check_training
    t = make_trainer(args, overrides + fixed, work / "megaloop")
    data = make_trainer(args, [], work / "loader")  # a second loader over the same batches
    hf = _hf_from_trainer(t)
    shape = Shape.of(t.cfg.model, t.vocab, mean_depth=max(depth - 1, 1), bptt_window=window)  # sampler patched below
    ref = load_reference("huginn", args.ref_path, shape, args.init_seed)
    transfer(hf, ref)
    ref.cfg.state_init = "zero"
    n_grad = min(window, depth)
    ref.model.randomized_iteration_sampler = lambda: (torch.tensor(depth - n_grad), torch.tensor(n_grad))
    # megatron's standard exclusions: 1-D tensors and biases (Huginn's own list also decays its QK biases)
    opt = make_optimizer(ref, lambda name, p: p.ndim < 2 or "bias" in name.rsplit(".", 1)[-1])
    warm = max(1, round(0.1 * args.steps))
    rows = []
    for step in range(steps):
        rec = t.train_step()
        lr = wsd_lr(step + 1, args.lr, args.steps, warm, 0.2)
        loss, _, norm = train_step(ref, opt, [next(data.loader_iter) for _ in range(data.M)], step, lr)
        rows.append({"step": step + 1, "lr": lr, "megaloop": rec["loss"], "reference": loss,
                     "grad_norm_megaloop": rec.get("grad_norm"), "grad_norm_reference": norm})
    diffs = [abs(r["megaloop"] - r["reference"]) for r in rows]
    first = next((r["step"] for r, d in zip(rows, diffs) if d > args.train_tol), None)
    return {"rows": rows, "depth": depth, "bptt_window": window, "schedule_steps": args.steps,
            "max_abs_diff": max(diffs), "first_step_over_tol": first, "tolerance": args.train_tol,
            "agree": first is None and all(math.isfinite(d) for d in diffs),
            "reference_commit": ref.commit}


def summary_lines(res: dict) -> list[str]:
    """Markdown: the loss difference at a few steps and the verdict."""
    rows = res["rows"]
    marks = sorted({1, 2, 5, 10, 20, 50, 100, 200, 400, 800, 1600, len(rows)} & set(range(1, len(rows) + 1)))
    out = ["| step | megaloop loss | Huginn loss | difference |", "|---|---|---|---|"]
    for s in marks:
        r = rows[s - 1]
        out.append(f"| {s} | {r['megaloop']:.5f} | {r['reference']:.5f} | {r['megaloop'] - r['reference']:+.2e} |")
    first = res["first_step_over_tol"]
    out.append("")
    out.append(f"max |difference| {res['max_abs_diff']:.2e} over {len(rows)} steps; " +
               (f"first above {res['tolerance']:g} at step {first}" if first else
                f"within {res['tolerance']:g} at every step"))
    return out
