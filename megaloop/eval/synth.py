"""Answer accuracy and answer CE of the synthetic programs per chain length k and depth R.

Input: held-out problems (``heldout.jsonl`` of ``data_prep/make_synth.py``, or the shipped
``megaloop/eval/tasks/megaloop_synth.jsonl``): records with ``k``, ``prompt`` (the program up to
``print(x%m)`` and its newline) and ``target`` (the printed value and its newline).

Scoring goes through the lm-eval adapter's own path (:class:`megaloop.eval.harness.MegaloopLM`:
same pair encoding, same :mod:`megaloop.eval.decode_score` scorers over the
:class:`~megaloop.inference.engine.InferenceEngine` and its KV caches), so the table equals what
``megaloop eval harness --tasks megaloop_synth`` reports at each depth. Default protocol: the
prompt is prefilled at R into a terminal-KV cache, the answer is fed token by token at R
(``scoring="decode"``); ``cache_mode="none"`` scores one plain parallel forward at R. With an
engine exit policy (``--exit``) the answer tokens of column R decode at adaptive depth capped at R
(:func:`megaloop.eval.depth_sweep.row_policy`, as ``eval sweep --sharing`` rows: ``latent:0``
equals fixed token-by-token decoding at R; fixed depth R where R is below ``min_depth``).

Per problem: ``ce`` = −Σ log p(continuation) in nats, the continuation being the target plus the
prompt's trailing newline (the adapter moves trailing whitespace of a context onto its
continuation); ``correct`` = every continuation token is the argmax, i.e. greedy decoding produces
exactly the answer and its terminating newline (exact match). Tables hold the means per k.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from megaloop.config_utils import ConfigError
from megaloop.eval.depth_sweep import parse_depths, row_policy
from megaloop.runtime.files import save_figure

SHIPPED = Path(__file__).resolve().parent / "tasks" / "megaloop_synth.jsonl"
DEFAULT_DEPTHS = (1, 2, 4, 5, 8, 16)


def load_problems(path: str | Path = SHIPPED, ks: Optional[Sequence[int]] = None,
                  limit_per_k: Optional[int] = None) -> list[dict]:
    """Records ``{k, prompt, target, ...}`` of a held-out JSONL (k filter, first ``limit_per_k``
    per k); errors name ``file:line`` and the field."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--problems: {path} " + ("is a directory, not a JSONL file" if path.is_dir() else
                                                     "does not exist"))
    if limit_per_k is not None and limit_per_k < 1:
        raise ConfigError(f"--limit: must be >= 1, got {limit_per_k}")
    out, per_k = [], {}
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"--problems: {path}: not UTF-8 ({err.reason} at byte {err.start})") from None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"--problems: {path}:{n}: invalid JSON ({err.msg})") from None
        if not isinstance(rec, dict):
            raise ConfigError(f"--problems: {path}:{n}: a record is a JSON object with k, prompt and target")
        for key, typ in (("k", int), ("prompt", str), ("target", str)):
            if not isinstance(rec.get(key), typ) or (typ is str and not rec[key]):
                raise ConfigError(f"--problems: {path}:{n}: field {key!r} missing or not a "
                                  f"{'non-empty string' if typ is str else 'integer'}")
        if ks is not None and rec["k"] not in ks:
            continue
        if limit_per_k is not None and per_k.get(rec["k"], 0) >= limit_per_k:
            continue
        per_k[rec["k"]] = per_k.get(rec["k"], 0) + 1
        out.append(rec)
    if not out:
        raise ConfigError(f"--problems: {path} holds no problem" + (f" with k in {list(ks)}" if ks else ""))
    if ks is not None and (absent := sorted(set(ks) - set(per_k))):
        print(f"note: --problems {path} holds no problem with k in {absent}: scoring k in {sorted(per_k)}",
              file=sys.stderr)
    return out


def run_tree(checkpoint: str | Path) -> tuple[Optional[Path], Optional[dict]]:
    """The synthetic tree a run trained on and its ``synth.json``: ``RUN/data.json`` names the MDS
    set, whose manifest names its input tree (``make_synth.py``'s completion mark is ``synth.json``).
    ``(None, None)`` when any link is missing (another corpus, a moved tree, an HF folder)."""
    from megaloop.data.tokenizer import find_relative, read_manifest

    p = Path(checkpoint)
    run = next((d for d in (p, p.parent, p.parent.parent) if (d / "data.json").is_file()), None)
    if run is None:
        return None, None
    data = str((read_manifest(run, "data.json") or {}).get("path") or "")
    folder = find_relative(data, run, lambda f: read_manifest(f) is not None) if data else None
    given = str((read_manifest(folder) or {}).get("input") or "") if folder is not None else ""
    # the converter records --input as typed (often relative to where it ran): looked up as data.path is
    tree = find_relative(given, folder, lambda t: read_manifest(t, "synth.json") is not None) if given else None
    info = read_manifest(tree, "synth.json") if tree is not None else None
    return (Path(tree), info) if info else (None, None)


def run_heldout(checkpoint: str | Path) -> Optional[Path]:
    """The held-out set (``heldout.jsonl``) of the synthetic tree a run trained on (:func:`run_tree`);
    None when there is none. The shipped set is the held-out set of the default settings only: a
    tree made with another modulus, ``--eval-seed``, ``--eval-ks`` or ``--eval-per-k`` trains on some of it."""
    tree, info = run_tree(checkpoint)
    if tree is None or not isinstance(info.get("heldout"), dict):
        return None
    held = tree / str(info["heldout"].get("file") or "heldout.jsonl")
    return held if held.is_file() else None


def old_generator_note(checkpoint: str | Path) -> Optional[str]:
    """A note when the run's synthetic tree was made by generator 1, whose training programs could
    begin with a held-out program and show its answer (``megaloop.data.synth`` docstring)."""
    from megaloop.data.synth import GENERATOR, tree_generator

    tree, info = run_tree(checkpoint)
    if tree is None or tree_generator(info) >= GENERATOR:
        return None
    return (f"note: {tree} was made by an earlier make_synth.py (synth.json has no \"generator\": {GENERATOR}): "
            "its training programs may begin with a held-out program and show that program's answer as a "
            "comment (with the defaults, 50/48/19 of the 50 held-out problems at k = 1/2/3); rebuild the tree "
            "and retrain for an uncontaminated table")


def _encode(lm, problems: Sequence[dict]) -> list[tuple[list[int], list[int]]]:
    """``problems`` as :class:`MegaloopLM` ``lm``'s (context, continuation) token pairs (the same at
    every depth). A problem longer than the context is refused: cutting its start (what the adapter
    does for lm-eval tasks) drops the assignment its answer depends on, and was silent; one past the
    training length is warned about (RoPE extrapolation)."""
    pairs = [lm._encode_pair(p["prompt"], p["target"]) for p in problems]
    lengths = [len(c) + len(t) - 1 for c, t in pairs]  # model inputs: context + answer[:-1]
    longest = max(lengths, default=0)
    if longest > lm.max_length:
        ks = sorted({p["k"] for p, n in zip(problems, lengths) if n > lm.max_length})
        raise ConfigError(f"--problems: {sum(n > lm.max_length for n in lengths)} problem(s) (k in {ks}) are longer "
                          f"than the model's context of {lm.max_length} tokens (longest {longest}): their start, "
                          f"which the answer depends on, would be cut; pass --max-context {longest} or leave "
                          "those k out (--ks)")
    from megaloop.post.rl.io import warn_rope_extrapolation

    warn_rope_extrapolation(lm.engine, longest, "the longest problems")
    return pairs


def score_problems(engine, problems: Sequence[dict], depth: int, *, cache_mode: str = "terminal",
                   scoring: Optional[str] = None, prefill_depth: Optional[int] = None,
                   batch_size: int = 64, memory_check: bool = True,
                   pairs: Optional[list] = None) -> list[tuple[float, bool]]:
    """Per problem ``(ce nats, correct)`` at recurrence depth ``depth`` (prefill at
    ``prefill_depth``, default ``depth``), through :class:`MegaloopLM`'s scorers (whose memory
    check refuses a batch that would not fit, unless ``memory_check`` is False). ``pairs``: the
    problems already encoded (:func:`synth_table` encodes them once for every depth). The engine's
    exit policy, if any, decodes capped at ``depth`` (:func:`row_policy`)."""
    lm = _lm(engine, depth, cache_mode=cache_mode, scoring=scoring, prefill_depth=prefill_depth,
             batch_size=batch_size, memory_check=memory_check)
    return [(-lp, bool(greedy)) for lp, greedy in lm._loglikelihood_tokens(pairs or _encode(lm, problems))]


def _lm(engine, depth: int, **kw):
    """The adapter scoring column ``depth``: decode budget ``depth``, the engine's exit policy capped at it."""
    from megaloop.eval.harness import MegaloopLM

    return MegaloopLM(engine, depth=depth, policy=row_policy(getattr(engine, "exit", None), depth), **kw)


@dataclass
class SynthTable:
    """``acc[i][j]`` / ``ce[i][j]``: mean exact match / answer CE (nats) of the problems with
    ``ks[i]`` at depth ``depths[j]``; ``n[i]`` problems per k; ``chance`` = 1/modulus if known;
    ``adaptive_depths[j]`` (with an exit policy): the depths the answer tokens of column j stopped
    at (criterion, min/max depth and :meth:`DepthLog.to_dict`), None where ``depths[j]`` is below
    ``min_depth`` (fixed depth)."""

    ks: list[int]
    depths: list[int]
    n: list[int]
    acc: list[list[float]]
    ce: list[list[float]]
    protocol: dict = field(default_factory=dict)
    chance: Optional[float] = None
    adaptive_depths: Optional[list] = None

    def to_dict(self) -> dict:
        return {"ks": self.ks, "depths": self.depths, "n": self.n, "acc": self.acc, "ce": self.ce,
                "protocol": self.protocol, "chance": self.chance, "adaptive_depths": self.adaptive_depths}

    def format(self) -> str:
        """Plain-text k × R table of ``acc / CE``."""
        head = ["k", "n"] + [f"R={r}" for r in self.depths]
        rows = [[str(k), str(n)] + [f"{a:.3f} / {c:.3f}" for a, c in zip(accs, ces)]
                for k, n, accs, ces in zip(self.ks, self.n, self.acc, self.ce)]
        width = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
        lines = ["  ".join(c.rjust(w) for c, w in zip(r, width)) for r in [head] + rows]
        note = "answer accuracy (exact match of the greedy answer) / answer CE (nats) per k (rows) and R"
        if self.chance is not None:
            note += f"; chance accuracy {self.chance:.3f}"
        return note + "\n" + "\n".join(lines)


def synth_table(engine, problems: Sequence[dict], depths: Sequence[int] = DEFAULT_DEPTHS, *,
                cache_mode: str = "terminal", scoring: Optional[str] = None,
                prefill_depth: Optional[int] = None, batch_size: int = 64, log=None,
                memory_check: bool = True) -> SynthTable:
    """The k × R table of ``problems`` (see :func:`score_problems`); ``log(depth, seconds)``
    after each depth. ``memory_check``: refuse, before the first depth runs, a batch that would
    not fit at the deepest of ``depths``. With an engine exit policy each column decodes
    adaptively capped at its R; its depths are logged per column (``adaptive_depths``) and also
    added to ``engine.depth_log``."""
    import time

    from megaloop.inference.adaptive import DepthLog

    depths = parse_depths(depths)
    if not problems:
        raise ConfigError("synth: no problem to score")
    how = scoring or ("parallel" if cache_mode == "none" else "decode")
    base = getattr(engine, "exit", None) if how == "decode" else None  # parallel scoring never decodes
    kw = dict(cache_mode=cache_mode, scoring=scoring, prefill_depth=prefill_depth, batch_size=batch_size)
    deepest = _lm(engine, max(depths), memory_check=memory_check, **kw)
    pairs = _encode(deepest, problems)
    deepest._check_memory(pairs)  # the deepest depth holds the most (per-visit banks, decode depth)
    ks = sorted({int(p["k"]) for p in problems})
    rows = {k: [i for i, p in enumerate(problems) if p["k"] == k] for k in ks}
    acc = [[0.0] * len(depths) for _ in ks]
    ce = [[0.0] * len(depths) for _ in ks]
    adaptive: list = []
    for j, r in enumerate(depths):
        t0 = time.time()
        policy = row_policy(base, r)
        if policy is None:  # fixed depth R
            scores = score_problems(engine, problems, r, memory_check=False, pairs=pairs, **kw)
            adaptive.append(None)
        else:  # this column's depths in a log of their own, then added to the engine's
            outer, engine.depth_log = engine.depth_log, DepthLog()
            try:
                scores = score_problems(engine, problems, r, memory_check=False, pairs=pairs, **kw)
            finally:
                log_r, engine.depth_log = engine.depth_log, outer
            outer.counts.update(log_r.counts)
            outer.row_recurrences += log_r.row_recurrences
            adaptive.append({"criterion": policy.spec, "min_depth": policy.min_depth, "max_depth": policy.max_depth,
                             **log_r.to_dict()})
        for i, k in enumerate(ks):
            mine = [scores[q] for q in rows[k]]
            acc[i][j] = sum(ok for _, ok in mine) / len(mine)
            ce[i][j] = sum(c for c, _ in mine) / len(mine)
        if log:
            log(r, time.time() - t0)
    mods = {p.get("modulus") for p in problems}
    chance = 1.0 / mods.pop() if len(mods) == 1 and None not in mods else None
    from megaloop.eval.harness import describe_policy

    exit_ = describe_policy(base)
    if exit_ is not None:
        exit_["max_depth"] = "R"  # each column's cap is its own depth
    return SynthTable(ks=ks, depths=list(depths), n=[len(rows[k]) for k in ks], acc=acc, ce=ce,
                      chance=chance, protocol={"cache_mode": cache_mode, "scoring": how,
                                               "prefill_depth": prefill_depth or "R",
                                               "decode_depth": "R" if how == "decode" else None, "exit": exit_},
                      adaptive_depths=adaptive if base is not None else None)


def plot_synth(table: SynthTable, path: str | Path, title: str = "synthetic programs: answer vs chain length") -> Path:
    """PNG (matplotlib Agg): accuracy and CE against k, one line per depth R."""
    import matplotlib

    from megaloop.runtime.files import new_figure

    fig, (ax_a, ax_c) = new_figure(1, 2, figsize=(10, 4), dpi=120)
    cmap = matplotlib.colormaps["viridis"]
    for j, r in enumerate(table.depths):
        color = cmap(j / max(1, len(table.depths) - 1))
        ax_a.plot(table.ks, [row[j] for row in table.acc], "o-", color=color, label=f"R={r}")
        ax_c.plot(table.ks, [row[j] for row in table.ce], "o-", color=color, label=f"R={r}")
    if table.chance is not None:
        ax_a.axhline(table.chance, color="grey", ls="--", lw=0.8, label="chance")
        ax_c.axhline(-math.log(table.chance), color="grey", ls="--", lw=0.8, label="ln m (uniform answer)")
    ax_a.set_ylim(-0.02, 1.02)
    for ax, name in ((ax_a, "answer accuracy (exact match)"), (ax_c, "answer CE (nats)")):
        ax.set_xlabel("chain length k")
        ax.set_ylabel(name)
        ax.set_xticks(table.ks)
        ax.grid(alpha=0.3)
    ax_a.legend(fontsize=8)
    fig.suptitle(title)
    return save_figure(fig, path)


__all__ = ["DEFAULT_DEPTHS", "SHIPPED", "SynthTable", "load_problems", "plot_synth", "score_problems",
           "synth_table"]
