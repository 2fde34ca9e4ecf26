"""SPEC §8 fixed-point solver: qualification rules on constructed maps (contraction, cycles, slow
drift, blow-up), and joint vs frozen-prefix iteration on a contractive looped model (Lemma 1)."""

from __future__ import annotations

import math

import pytest
import torch

from megaloop.config_utils import ConfigError
from megaloop.inference.fixed_point import Criteria, LoopedStepper, check_span, fixed_point_report, solve
from tests.inference.helpers import make_model


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _map(fn):
    return lambda h: (fn(h), [])


H0 = torch.randn(1, 3, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64).float()
TARGET = torch.randn(1, 3, 8, generator=torch.Generator().manual_seed(1)).float()


def test_contraction_qualifies_after_hold_confirmation_and_final_check():
    res = solve(_map(lambda h: TARGET + 0.5 * (h - TARGET)), H0)
    assert res.qualified and res.reason == "qualified"
    # hold completes 8 steps after the change first drops <= 1e-5; then 16 confirmation + 1 final
    assert res.steps == res.hold_at + 16 + 1
    assert (res.state - TARGET).abs().max() < 1e-5
    assert res.last_change <= 1e-5


def test_oscillating_maps_are_rejected_as_cycles():
    res = solve(_map(lambda h: -h), H0)  # period 2
    assert not res.qualified and res.reason == "cycle of period 2" and res.steps == 1024
    rot = torch.linalg.matrix_exp(torch.tensor([[0.0, -1.0], [1.0, 0.0]]) * (2 * math.pi / 5))
    res = solve(_map(lambda h: (h.reshape(-1, 2) @ rot.T).reshape(h.shape)), H0, Criteria(max_steps=200))
    assert not res.qualified and res.reason == "cycle of period 5"


def test_slow_drift_passes_the_hold_but_fails_confirmation():
    """Steps of ~9e-6 (relative) pass the 1e-5 hold, but 16 of them drift > 5e-5: no fixed point."""
    direction = torch.ones_like(H0) / math.sqrt(8)

    def drift(h):
        scale = h.norm(dim=-1, keepdim=True)
        return h + 9e-6 * scale * direction

    res = solve(_map(drift), TARGET.abs() + 1.0, Criteria(max_steps=300))
    assert not res.qualified and res.hold_at == 8 and res.restarts >= 10
    assert res.reason.startswith("drift during confirmation")
    # a drift stopping during confirmation (within 5e-5) still qualifies
    budget = {"n": 0}

    def settling(h):
        budget["n"] += 1
        return drift(h) if budget["n"] < 15 else h

    assert solve(_map(settling), TARGET.abs() + 1.0).qualified


def test_kv_changes_count_and_non_finite_states_fail():
    """A state at rest whose K/V keep moving is no fixed point; NaN states are rejected."""
    counter = {"n": 0}

    def moving_kv(h):
        counter["n"] += 1
        k = torch.full((1, 2, 3, 4), float(counter["n"]))
        return h, [(k, k)]

    res = solve(moving_kv, H0, Criteria(max_steps=50))
    assert not res.qualified and res.hold_at is None
    res = solve(_map(lambda h: h * float("nan")), H0)
    assert not res.qualified and res.reason == "non-finite state" and res.steps == 1
    with pytest.raises(ConfigError, match="at most 1024"):
        Criteria(max_steps=2048)


def contractive_model():
    """Parcae injection with small retention Λ ≈ e^-4 and a weak core: a contraction."""
    model = make_model("parcae_nonorm", seed=3, scale=0.05)
    with torch.no_grad():
        model.model.injection.alpha_log.fill_(1.0)  # Λ = exp(-softplus(Δ)·e) ≈ 0.03..0.1
        for layer in model.model.core:
            layer.self_attn.o_proj.weight.mul_(0.3)
            layer.mlp.down_proj.weight.mul_(0.3)
    return model


def test_joint_and_frozen_prefix_reach_the_same_fixed_point():
    model = contractive_model()
    ids = torch.randint(2, 32, (12,), generator=torch.Generator().manual_seed(4))
    row = check_span(model, ids, control_depth=1)
    assert row["qualified"], row
    assert row["state_gap"] < 1e-4 and row["kl"] < 1e-7 and row["top1_agree"]
    assert row["prefix_gap"] < 1e-5  # causal: the joint prefix states equal the prefix-only solve
    assert row["zero_init"]["qualified"] and row["zero_init"]["state_gap"] < 1e-4
    assert 8 + 16 + 1 <= row["joint"]["steps"] < 200
    # freezing an unconverged (depth-1) prefix instead leaves a much larger gap
    assert row["control"]["state_gap"] > 100 * row["state_gap"]
    # the frozen-prefix path is terminal sharing: at its fixed point the current token's K/V are
    # computed against frozen banks; stepping once more changes nothing
    pre = LoopedStepper(model, ids[None, :-1])
    h = pre.init_state()
    for _ in range(row["prefix"]["steps"]):
        h, kv = pre.step(h)
    assert (pre.step(h)[0] - h).abs().max() < 1e-5


def test_cycling_model_is_rejected():
    """Huginn injection with adapter [−I | 0] and a silenced core: h ← RMSNorm(−h), period 2."""
    model = make_model("huginn_linear", seed=2)
    d = model.config.hidden_size
    with torch.no_grad():
        model.model.injection.adapter.weight.zero_()
        model.model.injection.adapter.weight[:, :d] = -torch.eye(d)
        model.model.injection.adapter.bias.zero_()
        for layer in model.model.core:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    ids = torch.randint(2, 32, (2, 6), generator=torch.Generator().manual_seed(5))
    rep = fixed_point_report(model, ids, Criteria(max_steps=100), control_depth=None, zero_init=False)
    assert rep["num_spans"] == 2 and rep["num_qualified"] == 0
    assert rep["rejections"]["joint"] == {"cycle of period 2": 2}
    assert rep["state_gap"]["n"] == 0 and rep["depth"]["joint"]["median"] is None


def test_report_summarises_qualified_spans():
    model = contractive_model()
    ids = torch.randint(2, 32, (3, 8), generator=torch.Generator().manual_seed(6))
    rep = fixed_point_report(model.to(torch.bfloat16), ids, control_depth=5)  # solved in an FP32 copy
    assert next(model.parameters()).dtype == torch.bfloat16
    assert rep["num_qualified"] == 3 and rep["qualified_solves"] == {"prefix": 3, "joint": 3, "current": 3}
    assert rep["state_gap"]["max"] < 1e-4 and rep["kl"]["max"] < 1e-7
    assert rep["depth"]["joint"]["max"] >= rep["depth"]["joint"]["median"] >= 25
    assert rep["control"]["qualified"] == 3 and len(rep["spans"]) == 3
    with pytest.raises(ConfigError, match="at least 2 tokens"):
        check_span(model.float(), [3])


def test_spans_per_source_and_per_source_summary():
    from megaloop.inference.fixed_point import select_per_source

    sources = ["a", "a", "b", "a", "c", "b", "a", "b"]
    assert select_per_source(sources, 2) == [0, 1, 2, 5, 4]  # first 2 of each, sources in first-seen order
    assert select_per_source(sources, 16) == [0, 1, 3, 6, 2, 5, 7, 4]
    assert select_per_source(sources, 2, limit=4) == [0, 1, 2, 4]  # round-robin cut: a, b, c, then a
    with pytest.raises(ValueError, match="per_source"):
        select_per_source(sources, 0)
    model = contractive_model()
    ids = torch.randint(2, 32, (3, 6), generator=torch.Generator().manual_seed(8))
    rep = fixed_point_report(model, ids, control_depth=None, zero_init=False, sources=["x", "y", "x"])
    assert [r["source"] for r in rep["spans"]] == ["x", "y", "x"]
    assert list(rep["per_source"]) == ["x", "y"]
    assert rep["per_source"]["x"]["num_spans"] == 2 and rep["per_source"]["y"]["num_spans"] == 1
    assert sum(v["num_qualified"] for v in rep["per_source"].values()) == rep["num_qualified"] == 3
    assert rep["per_source"]["y"]["state_gap"]["max"] == rep["spans"][1]["state_gap"]
    with pytest.raises(ValueError, match="2 sources for 3 spans"):
        fixed_point_report(model, ids, sources=["x", "y"])
