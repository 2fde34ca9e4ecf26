"""Cost-balanced pipeline split of recurrences (megaloop.model.pipeline_split)."""

from __future__ import annotations

from itertools import combinations_with_replacement

import pytest

from megaloop.config import load_config
from megaloop.model.pipeline_split import SplitCosts, split_costs, split_recurrences


def _all_splits(r: int, S: int):
    """Every contiguous split of 0..r-1 into S (possibly empty) slices."""
    for cuts in combinations_with_replacement(range(r + 1), S - 1):
        edges = (0, *cuts, r)
        yield [(edges[v], edges[v + 1]) for v in range(S)]


def stage_costs(r: int, bounds: list[tuple[int, int]], costs: SplitCosts, window: int) -> list[float]:
    """Each stage's cost under ``bounds``, counted recurrence by recurrence (the oracle)."""
    window = max(0, min(window, r))
    S = len(bounds)
    return [sum(costs.core_grad if i >= r - window else costs.core_nograd for i in range(lo, hi))
            + (costs.pre if v == 0 else 0.0) + (costs.post if v == S - 1 else 0.0)
            for v, (lo, hi) in enumerate(bounds)]


def _uniform_rule(r: int, S: int, pre: float, core: float, post: float) -> list[tuple[int, int]]:
    """The split of earlier releases: every recurrence costs ``core``, midpoint ownership."""
    total = pre + r * core + post
    owner = [min(S - 1, int((pre + (i + 0.5) * core) * S / total)) for i in range(r)]
    out, start = [], 0
    for v in range(S):
        end = start
        while end < r and owner[end] <= v:
            end += 1
        out.append((start, end))
        start = end
    return out


def test_split_costs_by_hand() -> None:
    """tiny (d=128, 4 heads, SwiGLU 384, 1/2/1 layers, s=128, parcae_nonorm): a layer visit is
    2·d·3d + 2·d·d + 2·3·d·384 + 4·s·d = 98,304 + 32,768 + 294,912 + 65,536 = 491,520 FLOPs per
    token, the injection 4d = 512 (megaloop.train.flops: Λ⊙h and the add), the head 2·d·V =
    1,048,576 at V = 4,096."""
    cfg = load_config("tiny", []).model
    c = split_costs(cfg, 4096)
    layer = 491_520.0
    core = 2 + 4 * 128 / layer
    assert c.pre == pytest.approx(3.0)
    assert c.core_nograd == pytest.approx(core)
    assert c.core_grad == pytest.approx(3 * core)
    assert c.post == pytest.approx(3 * (1 + 2 * 128 * 4096 / layer))
    r = split_costs(load_config("tiny", ["model.recompute=true"]).model, 4096)
    assert r.core_grad == pytest.approx(4 * core) and r.pre == pytest.approx(4.0)


@pytest.mark.parametrize("costs", [SplitCosts(3.0, 2.0, 6.0, 9.8), SplitCosts(1.5, 2.0, 2.0, 2.0),
                                   SplitCosts(0.0, 1.0, 3.0, 0.0), SplitCosts(12.0, 2.0, 6.0, 30.0)])
def test_split_is_contiguous_and_minimises_the_bottleneck(costs: SplitCosts) -> None:
    """Exhaustive over every contiguous split (r <= 9, S <= 4, every window): the chosen split has
    the smallest achievable most-expensive stage, and among those the smallest sum of squares."""
    for S in (1, 2, 3, 4):
        for r in range(1, 10):
            for window in sorted({0, 1, 2, min(4, r), r}):
                got = split_recurrences(r, S, costs, window)
                assert len(got) == S and got[0][0] == 0 and got[-1][1] == r
                assert all(a[1] == b[0] and a[0] <= a[1] for a, b in zip(got, got[1:]))
                cost = stage_costs(r, got, costs, window)
                options = [stage_costs(r, s, costs, window) for s in _all_splits(r, S)]
                best = min(max(o) for o in options)
                assert max(cost) == pytest.approx(best, rel=1e-9)
                best_sq = min(sum(x * x for x in o) for o in options if max(o) <= best * (1 + 1e-9))
                assert sum(x * x for x in cost) == pytest.approx(best_sq, rel=1e-9)


def test_window_moves_work_to_early_stages() -> None:
    """Forward-only recurrences are a third of a backpropagated one: with a deep microbatch the
    early stages take more of them than the late ones take windowed recurrences."""
    costs = SplitCosts(pre=3.0, core_nograd=2.0, core_grad=6.0, post=3.0)
    assert split_recurrences(12, 2, costs, 4) == [(0, 9), (9, 12)]  # 3 + 8·2 + 6 = 25 | 3·6 + 3 = 21
    assert split_recurrences(12, 2, costs, 12) == [(0, 6), (6, 12)]  # 3 + 36 | 36 + 3


def test_never_worse_than_the_uniform_rule_at_scale() -> None:
    """L (d=2,048, vocab 65,536, window 10): at every depth 1..64 on 2, 4 and 8 stages the
    bottleneck stage costs no more than under the earlier uniform rule, and less at PP2 depth 20."""
    cfg = load_config("L", []).model
    costs = split_costs(cfg, 65536)
    for S in (2, 4, 8):
        for r in range(1, 65):
            w = min(r, cfg.bptt_window)
            new = max(stage_costs(r, split_recurrences(r, S, costs, w), costs, w))
            old = max(stage_costs(r, _uniform_rule(r, S, cfg.n_prelude + 0.5, cfg.n_core, cfg.n_coda + 1.0), costs, w))
            assert new <= old * (1 + 1e-12)
    w = cfg.bptt_window
    old = max(stage_costs(20, _uniform_rule(20, 2, 1.5, 2.0, 2.0), costs, w))
    assert max(stage_costs(20, split_recurrences(20, 2, costs, w), costs, w)) < 0.9 * old


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="r >= 1"):
        split_recurrences(0, 2, SplitCosts(1.0, 1.0, 3.0, 1.0), 0)
    with pytest.raises(ValueError, match="SplitCosts.post"):
        SplitCosts(1.0, 1.0, 3.0, -1.0)
    with pytest.raises(ValueError, match="SplitCosts.core_nograd"):
        SplitCosts(1.0, 0.0, 3.0, 1.0)
