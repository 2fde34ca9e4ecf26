"""The schedule simulator on hand-checkable schedules: equal costs give the textbook bubble for 1F1B
and interleaved 1F1B, a single heavy microbatch, transfer times, and megatron's schedule table."""

from __future__ import annotations

import itertools

import pytest

from megaloop.plan.pipeline_sim import inflight_order, programs, schedule_table, simulate, textbook_bubble


def _equal(kind: str, mb: int, v: int) -> float:
    return 1.0 if kind == "F" else 2.0


@pytest.mark.parametrize("pp,m", [(2, 1), (2, 2), (2, 8), (4, 4), (4, 8), (4, 2), (8, 16), (3, 7)])
def test_1f1b_equal_costs_is_textbook(pp: int, m: int) -> None:
    r = simulate(pp, m, _equal)
    assert r.bubble == pytest.approx((pp - 1) / (m + pp - 1), abs=1e-12)
    assert r.makespan == pytest.approx(3.0 * (m + pp - 1))  # (m + p - 1)(t_F + t_B)
    assert r.busy == [3.0 * m] * pp


@pytest.mark.parametrize("pp,vpp,m", [(3, 2, 6), (4, 2, 4), (4, 2, 8), (4, 2, 16), (4, 3, 8), (8, 2, 16), (4, 4, 8)])
def test_interleaved_equal_costs_is_textbook(pp: int, vpp: int, m: int) -> None:
    # a chunk holds 1/vpp of the model: F = 1/vpp, B = 2/vpp
    r = simulate(pp, m, lambda k, mb, v: _equal(k, mb, v) / vpp, vpp=vpp)
    assert r.bubble == pytest.approx((pp - 1) / (vpp * m + pp - 1), abs=1e-9)
    assert r.bubble == pytest.approx(textbook_bubble(pp, m, vpp))
    assert r.bubble < textbook_bubble(pp, m)  # interleaving shrinks the bubble


def test_single_heavy_microbatch_by_hand() -> None:
    """pp=2, m=2; microbatch 0 costs twice as much (F=2, B=4) on both stages, microbatch 1 F=1, B=2.
    rank0: F0 0-2, F1 2-3, waits for grad 0; rank1: F0 2-4, B0 4-8 (then exchanges with rank 0 at 8);
    rank0: B0 8-12; rank1: F1 8-9, B1 9-11; rank0: B1 12-14. Makespan 14, busy 9 per rank."""
    cost = {("F", 0): 2.0, ("B", 0): 4.0, ("F", 1): 1.0, ("B", 1): 2.0}
    r = simulate(2, 2, lambda k, mb, v: cost[(k, mb)])
    assert r.makespan == pytest.approx(14.0)
    assert r.busy == [9.0, 9.0]
    assert r.bubble == pytest.approx(1 - 18 / 28)
    t0 = {(k, mb): (a, b) for k, mb, _c, a, b in r.trace[0]}
    assert t0[("B", 0)] == (8.0, 12.0) and t0[("B", 1)] == (12.0, 14.0)
    # the same work spread evenly (F=1.5, B=3) is the textbook 1/3 bubble: unequal depths cost more
    even = simulate(2, 2, lambda k, mb, v: 1.5 if k == "F" else 3.0)
    assert even.busy == r.busy and even.bubble == pytest.approx(1 / 3) and even.bubble < r.bubble


def test_stage_imbalance_sets_the_pace() -> None:
    """Equal microbatches, last stage 3x slower: makespan = fill + m x the slow stage's F+B."""
    pp, m = 4, 8
    r = simulate(pp, m, lambda k, mb, v: _equal(k, mb, v) * (3.0 if v == pp - 1 else 1.0))
    assert r.makespan >= m * 9.0
    assert r.bubble > textbook_bubble(pp, m)


def test_transfer_time_by_hand() -> None:
    """pp=2, m=1, transfer tau: F0 [0,1] -> rank1 F at 1+tau, B ends 4+tau -> rank0 B at 4+2tau."""
    tau = 0.25
    r = simulate(2, 1, _equal, transfer=tau)
    assert r.makespan == pytest.approx(6.0 + 2 * tau)


def test_every_op_once_and_no_deadlock() -> None:
    for pp, vpp in itertools.product((2, 3, 4, 8), (1, 2, 3)):
        if vpp > 1 and pp < 3:
            continue
        for m in ([pp, 2 * pp, 3 * pp] if vpp > 1 else [1, 2, pp, 2 * pp + 1]):
            r = simulate(pp, m, lambda k, mb, v: 1.0 + (mb % 3) * (v % 2), vpp=vpp, transfer=0.1)
            for k, order in enumerate(inflight_order(pp, m, vpp)):
                ops = sorted(order)
                want = sorted((kind, mb, c) for kind in "BF" for mb in range(m) for c in range(vpp))
                assert ops == want, (pp, vpp, m, k)
                held = 0
                for kind, _mb, _c in order:  # a backward never precedes its forward
                    held += 1 if kind == "F" else -1
                    assert held >= 0
            assert r.makespan > 0


def test_eager_sends_never_slower() -> None:
    for pp, vpp, m in ((4, 1, 8), (4, 2, 8)):
        cost = lambda k, mb, v: 1.0 + 0.5 * ((mb * 7 + v) % 3)  # noqa: E731
        rv = simulate(pp, m, cost, vpp=vpp, transfer=0.05)
        ea = simulate(pp, m, cost, vpp=vpp, transfer=0.05, eager_sends=True)
        assert ea.makespan <= rv.makespan + 1e-12


def test_warmup_counts_match_megatron() -> None:
    """Forwards before the first backward: pp-rank-1 (1F1B), 2(pp-rank-1)+(vpp-1)pp (interleaved)."""
    for pp, vpp, m in ((4, 1, 8), (4, 2, 8), (8, 2, 16), (3, 3, 6)):
        for k, order in enumerate(inflight_order(pp, m, vpp)):
            first_b = next(i for i, op in enumerate(order) if op[0] == "B")
            warm = pp - k - 1 if vpp == 1 else 2 * (pp - k - 1) + (vpp - 1) * pp
            assert first_b == min(warm, m * vpp) + (1 if warm < m * vpp else 0)


def test_schedule_table_is_megatrons() -> None:
    from megatron.core.pipeline_parallel.schedules import get_schedule_table

    for m, vpp, group in ((8, 2, 4), (6, 3, 3), (5, 2, 3), (16, 2, 4)):
        assert schedule_table(m, vpp, group) == list(get_schedule_table(m, vpp, group))
    assert len(programs(4, 8, 2)) == 4
