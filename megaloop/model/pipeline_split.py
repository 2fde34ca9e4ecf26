"""Which recurrences each pipeline stage runs: a cost-balanced contiguous split.

A looped model's layer graph is cyclic, so pipeline parallelism splits *recurrences*: with
``S = pp·vpp`` virtual stages, stage 0 also runs the embedding and prelude, stage S−1 the coda,
final norm and head, and a microbatch of depth r runs recurrences ``split_recurrences(...)[v]`` on
stage v. The split minimises the most expensive stage's work for that microbatch, counting
what each piece costs in forward FLOPs per token, in units of one transformer layer visit:

- a recurrence outside the TBPTT window (index ``< r − b``) runs forward only: ``n_core`` (+ its
  injection);
- one inside the window runs forward and backward: ×3 (×4 with activation recomputation);
- the prelude (stage 0) and the coda + output head (stage S−1) always backpropagate; the head
  costs ``2·d·V`` per token, at vocab 65,536 and d=2,048 about 2.3 layer visits.

Among splits with the same bottleneck it takes the one with the smallest sum of squared stage
costs (work spread evenly over the other stages), then the one that gives earlier stages more.
Every rank computes the same split from the same (config, vocab, depth, window), so no
communication is needed. Memory-bound work (norms, the cross-entropy's passes over fp32 logits)
and the send/receive of the packed state are not counted. This module imports no megatron, so
the planner (``megaloop.plan.stages``) splits exactly as training does.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from megaloop.model.config import ModelConfig
from megaloop.train.flops import forward_flops_per_token, layer_flops_per_token


@dataclass(frozen=True)
class SplitCosts:
    """Per-token forward FLOPs of each piece of a microbatch, in layer-visit units (see module doc).

    ``pre``: embedding + prelude, forward and backward. ``core_nograd`` / ``core_grad``: one
    recurrence outside / inside the TBPTT window. ``post``: coda + final norm + head, forward and
    backward."""

    pre: float
    core_nograd: float
    core_grad: float
    post: float

    def __post_init__(self) -> None:
        for name in ("pre", "core_nograd", "core_grad", "post"):
            v = getattr(self, name)
            if not v >= 0.0:
                raise ValueError(f"SplitCosts.{name} must be >= 0, got {v}")
        if not self.core_nograd > 0.0:
            raise ValueError(f"SplitCosts.core_nograd must be > 0, got {self.core_nograd}")


def split_costs(cfg: ModelConfig, vocab: int) -> SplitCosts:
    """The costs of ``cfg``'s pieces at (padded) vocabulary size ``vocab``."""
    layer = layer_flops_per_token(cfg, cfg.seq_len)
    _, per_recurrence, head = forward_flops_per_token(cfg, vocab, cfg.seq_len, 1)
    grad = 4.0 if cfg.recompute else 3.0
    core = per_recurrence / layer
    return SplitCosts(pre=grad * cfg.n_prelude, core_nograd=core, core_grad=grad * core,
                      post=grad * (cfg.n_coda + head / layer))


def split_recurrences(r: int, stages: int, costs: SplitCosts, window: int) -> list[tuple[int, int]]:
    """Recurrences 0..r-1 of a depth-``r`` microbatch whose last ``window`` recurrences
    backpropagate, as ``stages`` contiguous ``(lo, hi)`` slices (stage v runs ``lo <= i < hi``;
    a slice may be empty)."""
    if r < 1 or stages < 1:
        raise ValueError(f"split_recurrences: need r >= 1 and stages >= 1, got r={r}, stages={stages}")
    return list(_split(r, stages, costs, max(0, min(window, r))))


@lru_cache(maxsize=4096)
def _split(r: int, S: int, costs: SplitCosts, window: int) -> tuple[tuple[int, int], ...]:
    if S == 1:
        return ((0, r),)
    prefix = [0.0]
    for i in range(r):
        prefix.append(prefix[-1] + (costs.core_grad if i >= r - window else costs.core_nograd))

    def cost(v: int, lo: int, hi: int) -> float:
        return (prefix[hi] - prefix[lo] + (costs.pre if v == 0 else 0.0)
                + (costs.post if v == S - 1 else 0.0))

    # 1) the smallest achievable bottleneck: best[v][i] = min over splits of recurrences i..r-1
    #    across stages v..S-1 of their most expensive stage.
    inf = float("inf")
    best = [[inf] * (r + 1) for _ in range(S + 1)]
    best[S][r] = 0.0
    for v in range(S - 1, -1, -1):
        for i in range(r + 1):
            ends = (r,) if v == S - 1 else range(i, r + 1)
            best[v][i] = min((max(cost(v, i, j), best[v + 1][j]) for j in ends), default=inf)
    bound = best[0][0] * (1 + 1e-12) + 1e-12
    # 2) within that bound, the smallest sum of squared stage costs; ties -> the larger slice first.
    sq = [[inf] * (r + 1) for _ in range(S + 1)]
    pick = [[0] * (r + 1) for _ in range(S)]
    sq[S][r] = 0.0
    for v in range(S - 1, -1, -1):
        for i in range(r + 1):
            ends = (r,) if v == S - 1 else range(r, i - 1, -1)
            for j in ends:
                c = cost(v, i, j)
                if c > bound or sq[v + 1][j] == inf:
                    continue
                q = c * c + sq[v + 1][j]
                if q < sq[v][i] * (1 - 1e-12) - 1e-12:
                    sq[v][i], pick[v][i] = q, j
    out, lo = [], 0
    for v in range(S):
        hi = pick[v][lo]
        out.append((lo, hi))
        lo = hi
    return tuple(out)

