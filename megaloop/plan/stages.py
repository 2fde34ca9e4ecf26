"""What each virtual pipeline stage runs for a microbatch of depth r (SPEC/DESIGN pipeline split).

With ``S = pp * vpp`` virtual stages, stage 0 holds the embedding and prelude, stage ``S-1`` the
coda, final norm and head, and every stage a core replica that runs the recurrences
``split_recurrences(r, ...)[v]`` (LoopedGPT.recurrence_slice, balanced by cost). Of those, the
ones at index ``>= r - b`` (TBPTT window ``b = min(r, bptt_window)``) backpropagate; the rest run
under no_grad.

The split is ``megaloop.model.pipeline_split`` (megatron-free), so the planner splits exactly as
training does.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from megaloop.model.config import ModelConfig
from megaloop.model.pipeline_split import SplitCosts, split_costs, split_recurrences


@dataclass(frozen=True)
class StageWork:
    """Work of one virtual stage for one microbatch: recurrences run, recurrences backpropagated,
    and whether it holds the embedding+prelude (``first``) / coda+head (``last``)."""

    stage: int
    recurrences: int
    grad_recurrences: int
    first: bool
    last: bool


def stage_work(cfg: ModelConfig, depth: int, stages: int, vocab: int,
               bptt_window: int | None = None) -> tuple[StageWork, ...]:
    """Per-virtual-stage work of a depth-``depth`` microbatch at padded vocabulary ``vocab``
    (``bptt_window`` default ``cfg.bptt_window``). An untied model splits its ``num_layers``
    evenly (counted as "recurrences" of one layer)."""
    return StageTable(cfg, stages, vocab, bptt_window)(depth)


class StageTable:
    """:func:`stage_work` of one (model config, stage count, padded vocab), memoised per depth.

    The planner asks for the same stages hundreds of thousands of times per search (memory
    replays, op durations); this computes ``split_costs`` once instead of at every call. Build it
    from a config that is not mutated afterwards (as :class:`~megaloop.plan.memory.MemoryModel` does)."""

    def __init__(self, cfg: ModelConfig, stages: int, vocab: int, bptt_window: int | None = None):
        self.cfg, self.stages, self.vocab = cfg, stages, vocab
        self.window = cfg.bptt_window if bptt_window is None else bptt_window
        self.costs = split_costs(cfg, vocab) if cfg.looped else None
        self._memo: dict[int, tuple[StageWork, ...]] = {}

    def __call__(self, depth: int) -> tuple[StageWork, ...]:
        w = self._memo.get(depth)
        if w is None:
            w = self._memo[depth] = self._work(depth)
        return w

    def _work(self, depth: int) -> tuple[StageWork, ...]:
        if self.costs is None:
            per = self.cfg.num_layers // self.stages
            return tuple(StageWork(v, per, per, v == 0, v == self.stages - 1) for v in range(self.stages))
        return _stage_work(self.costs, depth, self.stages, min(depth, self.window))


@lru_cache(maxsize=8192)
def _stage_work(costs: SplitCosts, depth: int, stages: int, b: int) -> tuple[StageWork, ...]:
    out = []
    for v, (lo, hi) in enumerate(split_recurrences(depth, stages, costs, b)):
        grad = max(0, hi - max(lo, depth - b))
        out.append(StageWork(v, hi - lo, grad, v == 0, v == stages - 1))
    return tuple(out)
