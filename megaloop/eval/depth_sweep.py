"""PPL across recurrence depths (the extrapolation test, SPEC §8) as a table and a PNG plot.

``depth_sweep(engine, data, depths)`` evaluates the native parallel-forward PPL at every depth
(default 1, 2, 4, 5, 8, 16, 32, 64) and, with ``sharing=True``, the half-prefill protocol with
terminal and per-visit caches and the sharing penalty at each depth. A model whose states settle
into fixed points keeps its PPL flat beyond the training depth; ``extrapolation`` reports
``PPL(R_max) / PPL(R_ref) − 1`` in percent (the paper's "R=64 vs training depth").
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from megaloop.config_utils import ConfigError
from megaloop.eval.ppl import EvalData, evaluate_ppl
from megaloop.inference.kv_cache import check_depth
from megaloop.runtime.files import new_figure, save_figure

DEFAULT_DEPTHS = (1, 2, 4, 5, 8, 16, 32, 64)


def parse_depths(text: str | Sequence[int]) -> list[int]:
    """``"1,2,4"`` (or a list) → sorted unique depths, each >= 1; an empty entry (``"3,,4"``, a
    trailing comma) is refused, as ``lr-screen --grid`` and ``reproduce --arms`` refuse theirs."""
    items = text.split(",") if isinstance(text, str) else list(text)
    out = []
    for item in items:
        if isinstance(item, str) and not item.strip():
            if isinstance(text, str) and text.strip():
                raise ConfigError(f"--depths: empty entry in {text!r} (expected comma-separated integers >= 1)")
            continue
        try:
            value = int(item)
        except ValueError:
            raise ConfigError(f"--depths: {item!r} is not an integer") from None
        out.append(check_depth(value, "--depths"))  # its ConfigError names the bad depth
    if not out:
        raise ConfigError("--depths: no depth given")
    return sorted(set(out))


def row_policy(policy, depth: int):
    """The adaptive-exit policy of a sweep row at depth ``depth``: ``policy`` capped at the row's R
    (``max_depth = R``, so ``latent:0`` equals fixed decoding at R); None (fixed depth R) when
    ``policy`` is None or R is below its ``min_depth`` (no criterion can fire before R then)."""
    if policy is None or depth < policy.min_depth:
        return None
    import dataclasses

    return dataclasses.replace(policy, max_depth=int(depth))


def depth_sweep(engine, data: EvalData, depths: Sequence[int] = DEFAULT_DEPTHS, *, sharing: bool = False,
                prefill_depth: Optional[int] = None, batch_size: int = 4, reference_depth: Optional[int] = None,
                log=None, prefix_len: Optional[int] = None) -> dict:
    """Rows ``{depth, native_ppl, [native_ppl_second_half, terminal_ppl, per_visit_ppl, sharing_penalty_pct]}``
    (``native_ppl`` over every position; the cache protocols and ``native_ppl_second_half`` over the
    positions after the prefix, the same tokens) plus
    ``reference_depth`` (default the engine's depth, i.e. the training/eval depth) and
    ``extrapolation_pct`` = 100·(PPL at the deepest depth / PPL at the reference − 1).
    ``prefix_len``: tokens prefilled by the sharing protocols (default half the sequence). With
    ``sharing`` and an engine exit policy, each row's cache protocols decode adaptively capped at
    the row's R (:func:`row_policy`; rows get ``adaptive_depths`` per protocol)."""
    depths = parse_depths(depths)
    ref = check_depth(reference_depth or engine.depth, "--reference-depth")
    protocols = ("native", "terminal", "per_visit") if sharing else ("native",)
    saved = getattr(engine, "exit", None)
    base = saved if sharing else None
    rows = []
    for d in sorted(set(depths) | {ref}):
        policy = row_policy(base, d)
        try:  # each row decodes adaptively with its own R as the cap (the decode depth of that row);
            # a row below min_depth, where no criterion can fire, decodes token by token at fixed R
            engine.exit = policy
            res = evaluate_ppl(engine, data, depth=d, prefill_depth=prefill_depth, protocols=protocols,
                               batch_size=batch_size, prefix_len=prefix_len,
                               stepwise=base is not None and policy is None)
        finally:
            engine.exit = saved
        row = {"depth": d, "native_ppl": res.native_ppl, "seconds": res.seconds, "in_sweep": d in depths}
        if sharing:
            row.update(native_ppl_second_half=res.native_ppl_second_half,  # the positions the caches score
                       terminal_ppl=res.terminal_ppl, per_visit_ppl=res.per_visit_ppl,
                       sharing_penalty_pct=res.sharing_penalty_pct)
            if base is not None:  # None: R < min_depth, the row decodes at fixed depth R
                row["adaptive_depths"] = res.adaptive_depths
        rows.append(row)
        if log:
            log(row)
    by_depth = {r["depth"]: r for r in rows}
    deepest = max(depths)
    extrap = 100.0 * (by_depth[deepest]["native_ppl"] / by_depth[ref]["native_ppl"] - 1.0)
    return {"depths": depths, "rows": [r for r in rows if r["in_sweep"]], "reference_depth": ref,
            "reference_native_ppl": by_depth[ref]["native_ppl"], "deepest": deepest,
            "extrapolation_pct": extrap, "num_seqs": data.num_seqs, "seq_len": data.seq_len,
            "prefix_len": res.prefix_len, "sharing": sharing}


def plot_sweep(result: dict, path: str | Path, title: str = "PPL vs recurrence depth") -> Path:
    """Write a PNG (matplotlib Agg): PPL against depth (log2 x axis), one line per protocol."""
    rows = result["rows"]
    xs = [r["depth"] for r in rows]
    fig, ax = new_figure(figsize=(6, 4), dpi=120)
    series = [("native_ppl", "native (parallel forward, all positions)", "o-"),
              ("native_ppl_second_half", "native (after the prefix)", "x-"),  # with --sharing: the caches' tokens
              ("terminal_ppl", "terminal KV sharing", "s--"), ("per_visit_ppl", "per-visit (full KV)", "^:")]
    for key, label, style in series:
        if key in rows[0]:
            ax.plot(xs, [r[key] for r in rows], style, label=label)
    ax.axvline(result["reference_depth"], color="grey", lw=0.8, ls="--", label=f"R={result['reference_depth']}")
    ax.set_xscale("log", base=2)
    lo, hi = min(xs + [result["reference_depth"]]), max(xs + [result["reference_depth"]])
    if lo == hi:  # one depth: a log axis of zero width would draw nothing
        ax.set_xlim(lo / 2 ** 0.5, hi * 2 ** 0.5)
    ax.set_xticks(xs)
    ax.set_xticklabels([str(x) for x in xs])
    ax.set_xlabel("recurrences R")
    ax.set_ylabel("perplexity")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, path)


__all__ = ["DEFAULT_DEPTHS", "depth_sweep", "parse_depths", "plot_sweep", "row_policy"]
