"""``megaloop rl grad-check``: how well endpoint reuse approximates the recompute gradient (paper appendix).

    megaloop rl grad-check --model hf/S --task arithmetic --prompts 8 --group-size 4 \\
        --depth 5 --neumann-b 5

One rollout of ``--prompts x --group-size`` completions (terminal KV cache, saved endpoints), then
the whole-step GRPO surrogate's gradient with each arm on the same rollout: ``reuse`` (Neumann-(b-1)
at the rollout's endpoints), ``recompute`` (endpoints rebuilt by a no-grad parallel pass at depth R,
same Neumann backward) and, with ``--bptt``, full BPTT through R. Prints one JSON object: the
pairwise cosines of the flattened gradients, their norms, and the largest endpoint residual.
"""

from __future__ import annotations

import argparse
import json
import random

from megaloop.post.rl.reuse import ARMS
from megaloop.runtime.argtypes import seed_int


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megaloop rl grad-check", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="megaloop checkpoint or HF folder")
    p.add_argument("--task", default="arithmetic")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--neumann-b", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--cache-mode", choices=("terminal", "per_visit"), default="terminal")
    p.add_argument("--bptt", action="store_true", help="also compare with full BPTT through R")
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument("--device", default=None)
    return p


def grad_check(model, tokenizer, task, cfg, arms=("reuse", "recompute")) -> dict:
    """Cosines between the arms' whole-step gradients on one rollout (gradients left cleared)."""
    import torch

    from megaloop.post.rl.grpo import rollout, row_generator, surrogate_loss
    from megaloop.post.rl.parts import HFLoopedParts
    from megaloop.post.rl.reuse import backward, cosine, flat_grad

    parts = HFLoopedParts(model)
    params = parts.parameters()
    examples = task.sample(cfg.prompts_per_step, random.Random(f"{cfg.seed}:0"))
    rows = list(range(cfg.prompts_per_step * cfg.group_size))
    batches = rollout(model, tokenizer, task, examples, cfg, rows=rows,
                      row_generators=[row_generator(cfg.seed, 0, j) for j in rows])
    n_seqs = len(rows)
    n_tokens = int(sum(float(b.mask.sum()) for b in batches))
    live = [b for b in batches if bool(b.advantages.abs().sum() > 0)]
    rewards = torch.cat([b.rewards for b in batches])
    out: dict = {"rows": n_seqs, "tokens": n_tokens, "reward_mean": float(rewards.mean()),
                 "batches_with_signal": len(live), "depth": cfg.depth, "neumann_b": cfg.neumann_b}
    if not live:
        out["error"] = "every group has equal rewards: no gradient (raise --group-size/--temperature or change --task)"
        return out
    grads, residual = {}, 0.0
    for arm in arms:
        model.zero_grad(set_to_none=True)
        for b in live:
            st = backward(arm, parts, b.ids[:, :-1], surrogate_loss(b, cfg, n_seqs, n_tokens),
                          depth=cfg.depth, b=cfg.neumann_b, z_end=b.endpoints)
            if st.residual is not None:
                residual = max(residual, st.residual)
        grads[arm] = flat_grad(params)
        out[f"grad_norm_{arm}"] = float(grads[arm].norm())
    model.zero_grad(set_to_none=True)
    for i, a in enumerate(arms):
        for b in arms[i + 1:]:
            out[f"cosine_{a}_{b}"] = cosine(grads[a], grads[b])
    out["endpoint_residual_max"] = residual
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from megaloop.post.rl.grpo import GRPOConfig
    from megaloop.config_utils import ConfigError
    from megaloop.hf.load import load_model
    from megaloop.post.rl.io import model_tokenizer
    from megaloop.post.rl.tasks import make_task

    try:
        cfg = GRPOConfig(arm="reuse", depth=args.depth, neumann_b=args.neumann_b,
                         group_size=args.group_size, prompts_per_step=args.prompts,
                         max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                         cache_mode=args.cache_mode, seed=args.seed)
        task = make_task(args.task)
    except ValueError as err:
        raise ConfigError(str(err)) from None  # reported by megaloop rl's main: one line, exit 2
    model, source = load_model(args.model, num_recurrences=args.depth)
    tok = model_tokenizer(args.tokenizer, args.model, source)
    if tok is None:
        raise ConfigError(f"--tokenizer: no tokenizer found for {args.model}; pass --tokenizer")
    model.to(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    arms = ARMS if args.bptt else ("reuse", "recompute")
    res = grad_check(model, tok, task, cfg, arms)
    print(json.dumps(res))
    return 0 if "error" not in res else 1
