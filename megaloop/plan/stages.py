"""What each virtual pipeline stage runs for a microbatch of depth r (SPEC/DESIGN pipeline split).

With ``S = pp * vpp`` virtual stages, stage 0 holds the embedding and prelude, stage ``S-1`` the
coda, final norm and head, and every stage a core replica that runs the recurrences
``split_recurrences(r)[v]`` (LoopedGPT.recurrence_slice). Of those, the ones at index
``>= r - b`` (TBPTT window ``b = min(r, bptt_window)``) backpropagate; the rest run under no_grad.

``split_recurrences`` is read from ``megaloop/model/looped.py`` itself (its source, without
importing megatron), so the planner splits exactly as training does.
"""

from __future__ import annotations

import ast
import importlib.util
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

from megaloop.model.config import ModelConfig


@lru_cache(maxsize=1)
def _split_fn() -> Callable[..., list[tuple[int, int]]]:
    """``megaloop.model.looped.split_recurrences``, compiled from the module's source (that module
    imports megatron-core, ~4 s); falls back to importing it."""
    try:
        spec = importlib.util.find_spec("megaloop.model.looped")
        src = Path(spec.origin).read_text()
        node = next(n for n in ast.parse(src).body
                    if isinstance(n, ast.FunctionDef) and n.name == "split_recurrences")
        mod = ast.Module(body=[ast.ImportFrom(module="__future__", names=[ast.alias("annotations")], level=0),
                               node], type_ignores=[])
        ns: dict = {}
        exec(compile(ast.fix_missing_locations(mod), spec.origin, "exec"), ns)  # noqa: S102 - our own source
        fn = ns["split_recurrences"]
        fn(5, 2, 1.5, 2.0, 2.0)  # it must run on its own (no other module names)
        return fn
    except Exception:  # pragma: no cover - source not readable (zipped install)
        from megaloop.model.looped import split_recurrences

        return split_recurrences


def split_weights(cfg: ModelConfig) -> tuple[float, float, float]:
    """(pre, core, post) weights LoopedGPT.recurrence_slice passes to split_recurrences."""
    return cfg.n_prelude + 0.5, float(cfg.n_core), cfg.n_coda + 1.0


@dataclass(frozen=True)
class StageWork:
    """Work of one virtual stage for one microbatch: recurrences run, recurrences backpropagated,
    and whether it holds the embedding+prelude (``first``) / coda+head (``last``)."""

    stage: int
    recurrences: int
    grad_recurrences: int
    first: bool
    last: bool


def stage_work(cfg: ModelConfig, depth: int, stages: int, bptt_window: int | None = None) -> tuple[StageWork, ...]:
    """Per-virtual-stage work of a depth-``depth`` microbatch (``bptt_window`` default ``cfg.bptt_window``).
    An untied model splits its ``num_layers`` evenly (counted as "recurrences" of one layer)."""
    b = min(depth, cfg.bptt_window if bptt_window is None else bptt_window)
    return _stage_work(cfg.looped, cfg.num_layers, cfg.n_prelude, cfg.n_core, cfg.n_coda, depth, stages, b)


@lru_cache(maxsize=8192)
def _stage_work(looped: bool, num_layers: int, n_prelude: int, n_core: int, n_coda: int, depth: int,
                stages: int, b: int) -> tuple[StageWork, ...]:
    if not looped:
        per = num_layers // stages
        return tuple(StageWork(v, per, per, v == 0, v == stages - 1) for v in range(stages))
    bounds = _split_fn()(depth, stages, n_prelude + 0.5, float(n_core), n_coda + 1.0)
    out = []
    for v, (lo, hi) in enumerate(bounds):
        grad = max(0, hi - max(lo, depth - b))
        out.append(StageWork(v, hi - lo, grad, v == 0, v == stages - 1))
    return tuple(out)
