"""Depth-use diagnostics (``megaloop eval states``) against hand computations."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megaloop.eval.states import state_diagnostics, trace_export
from megaloop.hf import MegaloopConfig, MegaloopForCausalLM

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_diagnostics_of_given_states_equal_explicit_loops():
    g = torch.Generator().manual_seed(0)
    e = torch.randn(2, 3, 4, generator=g)
    states = [torch.randn(2, 3, 4, generator=g) for _ in range(4)]  # h^0..h^3
    parts = [(torch.randn(2, 3, 4, generator=g), torch.randn(2, 3, 4, generator=g)) for _ in range(3)]
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    out = state_diagnostics(e, states, parts, mask=mask)
    toks = [(b, t) for b in range(2) for t in range(3) if mask[b, t]]

    def norm(v):
        return math.sqrt(sum(float(x) ** 2 for x in v))

    assert out["rms_e"] == pytest.approx(math.sqrt(sum(float(e[b, t, c]) ** 2 for b, t in toks for c in range(4))
                                                   / (4 * len(toks))), rel=1e-12)
    for r in (1, 2, 3):
        row = out["per_recurrence"][r - 1]
        rel = [norm(states[r][b, t] - states[r - 1][b, t]) / norm(states[r][b, t]) for b, t in toks]
        assert row["rel_change"] == pytest.approx(sum(rel) / len(rel), rel=1e-12)
        s, i = parts[r - 1]
        share = [norm(s[b, t]) / (norm(s[b, t]) + norm(i[b, t])) for b, t in toks]
        assert row["state_share"] == pytest.approx(sum(share) / len(share), rel=1e-12)
        rms = math.sqrt(sum(float(x) ** 2 for b, t in toks for x in states[r][b, t]) / (4 * len(toks)))
        assert row["rms_h"] == pytest.approx(rms, rel=1e-12)
        if r >= 2:
            num = math.sqrt(sum(norm(states[r][b, t] - states[r - 1][b, t]) ** 2 for b, t in toks))
            den = math.sqrt(sum(norm(states[r - 1][b, t] - states[r - 2][b, t]) ** 2 for b, t in toks))
            assert row["contraction"] == pytest.approx(num / den, rel=1e-12)
        else:
            assert math.isnan(row["contraction"])


def _model(injection: str) -> MegaloopForCausalLM:
    torch.manual_seed(0)
    cfg = MegaloopConfig(vocab_size=64, hidden_size=32, num_attention_heads=4, n_prelude=1, n_core=2, n_coda=1,
                         injection=injection, state_init_std=0.3, eval_seed=1, num_recurrences=3)
    model = MegaloopForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model.double().eval()


@pytest.mark.parametrize("injection", ["parcae_nonorm", "huginn_linear"])
def test_trace_of_a_fixed_tiny_model_equals_a_hand_recurrence(injection):
    """States, injection split and diagnostics from trace_export equal a recurrence written out
    here from the parameters (diagonal: Λ⊙h + Δ⊙(W e); linear: W_h h + W_e e + b, exit RMSNorm)."""
    model = _model(injection)
    mm = model.model
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(2))
    tr = trace_export(model, ids, 4)
    with torch.no_grad():
        x = mm.embed_tokens(ids)
        pos = torch.arange(5)[None].expand(2, 5)
        from megaloop.hf.modeling_megaloop import rotary_cos_sin

        rope = rotary_cos_sin(pos, mm.config.head_dim, mm.config.rope_theta, x.dtype)
        e = mm.prelude[0](x, rope, None, None)[0]
        h = (mm.eval_noise_rows(pos) * 0.3).to(e.dtype)  # FP32 table, as the model
        inj = mm.injection
        states, parts = [h], []
        for _ in range(4):
            if injection == "parcae_nonorm":
                delta = F.softplus(inj.delta_raw)
                lam = torch.exp(-delta * torch.exp(inj.alpha_log))
                s_part, i_part = lam * h, delta * (e @ inj.proj.T)
            else:
                d = h.shape[-1]
                w, b = inj.adapter.weight, inj.adapter.bias
                s_part, i_part = h @ w[:, :d].T, e @ w[:, d:].T + b
            z = s_part + i_part
            for layer in mm.core:
                z = layer(z, rope, None, None)[0]
            if injection == "huginn_linear":
                z = z / torch.sqrt(z.pow(2).mean(-1, keepdim=True) + mm.config.exit_norm_eps)
            parts.append((s_part, i_part))
            h = z
            states.append(h)
    assert torch.allclose(tr["e"], e, atol=1e-10)
    diffs = [float((a - b).abs().max()) for a, b in zip(tr["states"], states)]
    assert max(diffs) < 1e-6, diffs  # the injection computes Δ, Λ and q in FP32 (as in training)
    for (a1, a2), (b1, b2) in zip(tr["parts"], parts):
        assert torch.allclose(a1, b1, atol=1e-6) and torch.allclose(a2, b2, atol=1e-6)
    got = state_diagnostics(**tr)
    want = state_diagnostics(e, states, parts)
    for r1, r2 in zip(got["per_recurrence"], want["per_recurrence"]):
        for k in ("rel_change", "state_share", "rms_h"):
            assert r1[k] == pytest.approx(r2[k], rel=1e-6)


@pytest.mark.parametrize("injection", ["parcae_nonorm", "huginn_linear"])
def test_streamed_diagnostics_equal_the_full_trace(injection):
    """``eval states`` streams (trace_diagnostics: three states at a time; the full trace's 3R + 2
    tensors were OOM-killed at R = 100,000): every number equals state_diagnostics of trace_export."""
    from megaloop.eval.states import trace_diagnostics

    model = _model(injection)
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(3))
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    want = state_diagnostics(mask=mask, **trace_export(model, ids, 6))
    grad_on = []  # the trace builds no autograd graph (one release lost the decorator: memory grew with R)
    hooks = [m.register_forward_hook(lambda *_: grad_on.append(torch.is_grad_enabled())) for m in model.modules()]
    got = trace_diagnostics(model, ids, 6, mask=mask)
    for h in hooks:
        h.remove()
    assert grad_on and not any(grad_on) and torch.is_grad_enabled()
    assert got["rms_e"] == want["rms_e"]
    assert [r.keys() for r in got["per_recurrence"]] == [r.keys() for r in want["per_recurrence"]]
    for r1, r2 in zip(got["per_recurrence"], want["per_recurrence"]):
        for k, v in r2.items():
            assert r1[k] == v or (math.isnan(v) and math.isnan(r1[k])), (r1["r"], k)


def test_bad_traces_are_refused():
    e = torch.zeros(1, 2, 3)
    with pytest.raises(ValueError, match="states"):
        state_diagnostics(e, [e], [])
    with pytest.raises(ValueError, match="parts"):
        state_diagnostics(e, [e, e, e], [None])
