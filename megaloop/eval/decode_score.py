"""Log-likelihood scoring of (context, continuation) token pairs for the lm-eval adapter.

Two scoring modes (``MegaloopLM(scoring=...)`` / ``megaloop eval harness --scoring``):

* ``decode`` (default; the paper's protocol for choice tasks): the context is prefilled at the
  prefill budget P (parallel pass, as in training) into a KV cache, then the continuation is fed
  **one token at a time** at the decode budget D through that cache. With a ``terminal`` cache
  every continuation token reads earlier continuation tokens through their terminal banks, exactly
  as in generation. The log-prob of continuation token k comes from the step that consumed token
  k-1 (token 0: the prefill's last position). Pairs are batched: rows are sorted by context so
  choices of one question share one prefill (the prefilled rows are copied per continuation),
  contexts of different lengths are left-padded (padding is masked and positions count real
  tokens, so a row scores the same alone or in a batch), and rows whose continuation has ended
  are dropped from the batch.
* ``parallel`` (faster): the prefilled context is followed by **one** parallel pass over the
  continuation at depth R, whose tokens read each other depth-matched (as in training) and the
  context through the cache. With ``cache_mode="none"`` context + continuation run as one plain
  parallel forward at R (no cache).

Both return, per pair, ``(sum of log p(continuation | context), continuation is greedy)``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from megaloop.config_utils import ConfigError
from megaloop.inference.kv_cache import check_depth, check_mode, select_rows

SCORING_MODES = ("decode", "parallel")
Pair = tuple[list[int], list[int]]  # (context ids, continuation ids), both non-empty


def check_scoring(scoring: str, cache_mode: str) -> str:
    """Validate ``--scoring`` against ``--cache`` (``none`` has no cache to decode through)."""
    if scoring not in SCORING_MODES:
        raise ConfigError(f"--scoring: one of {SCORING_MODES}, got {scoring!r}")
    if scoring == "decode" and cache_mode == "none":
        raise ConfigError("--scoring decode: token-by-token decoding needs a KV cache "
                          "(--cache terminal|per_visit); --cache none scores in one parallel pass")
    return scoring


def _step_scores(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(targets) [b] in FP64, targets are the argmax [b]) from logits [b, V]."""
    lp = torch.log_softmax(logits.float(), -1)
    return lp.gather(-1, targets[:, None]).squeeze(-1).double(), lp.argmax(-1) == targets


@torch.no_grad()
def decode_loglikelihood(engine, pairs: Sequence[Pair], *, prefill_depth: int, decode_depth: int,
                         cache_mode: str = "terminal", batch_size: int = 16,
                         policy=None) -> list[tuple[float, bool]]:
    """Token-by-token scores of ``pairs`` through a ``cache_mode`` cache: prefill each context at
    ``prefill_depth``, feed continuation tokens one per step at ``decode_depth``, or, with an
    adaptive-exit ``policy`` (:class:`~megaloop.inference.adaptive.ExitPolicy`; ``--exit``), at
    per-token depth up to ``policy.max_depth`` (the decode depth is then unused: the caller caps the
    policy, e.g. :func:`megaloop.eval.depth_sweep.row_policy`; depths go to ``engine.depth_log``).
    ``batch_size`` rows (pairs) are decoded together; a context is prefilled once per batch."""
    pdepth = check_depth(prefill_depth, "--prefill-depth")
    ddepth = check_depth(decode_depth, "--decode-depth")
    mode = check_mode(cache_mode, "--cache")
    if batch_size < 1:
        raise ConfigError(f"--batch-size: must be >= 1, got {batch_size}")
    dev = engine.device
    order = sorted(range(len(pairs)), key=lambda i: (-len(pairs[i][0]), pairs[i][0], -len(pairs[i][1])))
    results: list[Optional[tuple[float, bool]]] = [None] * len(pairs)
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        contexts: list[list[int]] = []
        row_of: dict[tuple, int] = {}
        for i in chunk:
            key = tuple(pairs[i][0])
            if key not in row_of:
                row_of[key] = len(contexts)
                contexts.append(list(key))
        state = engine.prefill(contexts, depth=pdepth, decode_depth=ddepth, cache_mode=mode)
        state = state.select([row_of[tuple(pairs[i][0])] for i in chunk])
        conts = [pairs[i][1] for i in chunk]
        total = torch.zeros(len(chunk), dtype=torch.float64, device=dev)
        greedy = torch.ones(len(chunk), dtype=torch.bool, device=dev)
        rows = list(range(len(chunk)))  # chunk row of each state row
        logits = state.logits
        for k in range(max(len(c) for c in conts)):
            targets = torch.tensor([conts[j][k] for j in rows], dtype=torch.long, device=dev)
            sel = torch.tensor(rows, dtype=torch.long, device=dev)
            lp, top = _step_scores(logits, targets)
            total[sel] += lp
            greedy[sel] &= top
            keep = [j for j, r in enumerate(rows) if len(conts[r]) > k + 1]
            if not keep:
                break
            if len(keep) < len(rows):
                state = state.select(keep)
                rows = [rows[j] for j in keep]
                targets = targets[torch.tensor(keep, dtype=torch.long, device=dev)]
            logits = engine.decode(state, targets, depth=ddepth, policy=policy)
        for j, i in enumerate(chunk):
            results[i] = (float(total[j]), bool(greedy[j]))
    return results  # type: ignore[return-value]


@torch.no_grad()
def parallel_loglikelihood(engine, pairs: Sequence[Pair], *, depth: int, prefill_depth: int,
                           cache_mode: str = "terminal", batch_size: int = 16) -> list[tuple[float, bool]]:
    """One-pass scores of ``pairs``: prefill the context at ``prefill_depth`` into a
    ``cache_mode`` cache and score the continuation in one parallel pass at ``depth``; with
    ``cache_mode="none"`` one plain parallel forward at ``depth`` over context + continuation.
    Pairs sharing a context share its prefill; ``batch_size`` continuations per pass."""
    depth = check_depth(depth, "--depth")
    pdepth = check_depth(prefill_depth, "--prefill-depth")
    if cache_mode != "none":
        check_mode(cache_mode, "--cache")
    groups: dict[tuple, list[int]] = {}
    for i, (ctx, _) in enumerate(pairs):
        groups.setdefault(tuple(ctx), []).append(i)
    results: list[Optional[tuple[float, bool]]] = [None] * len(pairs)
    for ctx, idx in groups.items():
        scores = _parallel_group(engine, list(ctx), [pairs[i][1] for i in idx], depth, pdepth, cache_mode,
                                 batch_size)
        for i, res in zip(idx, scores):
            results[i] = res
    return results  # type: ignore[return-value]


def _score_rows(engine, logits: torch.Tensor, cont: list[int]) -> tuple[float, bool]:
    """Sum of log p(cont) from logits [len(cont), V] and whether cont is the greedy choice."""
    lp = torch.log_softmax(logits[:, :engine.vocab_size].float(), -1)
    target = torch.tensor(cont, device=lp.device)
    return float(lp.gather(-1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all())


def _parallel_group(engine, ctx: list[int], conts: list[list[int]], depth: int, pdepth: int, cache_mode: str,
                    batch_size: int) -> list[tuple[float, bool]]:
    dev = engine.device
    out: list[tuple[float, bool]] = []
    if cache_mode == "none":
        for i in range(0, len(conts), batch_size):
            chunk = conts[i:i + batch_size]
            width = max(len(c) for c in chunk) - 1
            ids = torch.full((len(chunk), len(ctx) + width), engine.pad_id, dtype=torch.long)
            for j, c in enumerate(chunk):  # right padding never reaches earlier positions
                ids[j, :len(ctx) + len(c) - 1] = torch.tensor(ctx + c[:-1])
            logits = engine.forward(ids, depth)
            for j, c in enumerate(chunk):
                out.append(_score_rows(engine, logits[j, len(ctx) - 1:len(ctx) - 1 + len(c)], c))
        return out
    cache = engine.model.new_cache(cache_mode)
    first = engine.model(torch.tensor([ctx], dtype=torch.long, device=dev), past_key_values=cache, use_cache=True,
                         num_recurrences=pdepth, logits_to_keep=1).logits.float()[0, -1]
    for i in range(0, len(conts), batch_size):
        chunk = conts[i:i + batch_size]
        width = max(len(c) for c in chunk) - 1
        rest = None
        if width > 0:
            ids = torch.full((len(chunk), width), engine.pad_id, dtype=torch.long, device=dev)
            for j, c in enumerate(chunk):
                if len(c) > 1:
                    ids[j, :len(c) - 1] = torch.tensor(c[:-1])
            rows = select_rows(cache, [0] * len(chunk))
            rest = engine.model(ids, past_key_values=rows, use_cache=True, num_recurrences=depth).logits.float()
        for j, c in enumerate(chunk):
            lg = first[None] if rest is None else torch.cat([first[None], rest[j, :len(c) - 1]])
            out.append(_score_rows(engine, lg, c))
    return out


__all__ = ["SCORING_MODES", "check_scoring", "decode_loglikelihood", "parallel_loglikelihood"]
