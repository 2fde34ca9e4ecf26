"""Endpoint-reuse gradient (SPEC §9): Neumann-b → implicit gradient, geometric bias decay, equality
with full BPTT at a converged trajectory, R-independent memory, HF and native adapters."""

from __future__ import annotations

import pytest
import torch

from megaloop.post.rl.parts import HFLoopedParts, LoopedParts
from megaloop.post.rl.reuse import (SavedTensorMeter, bptt_backward, cosine, endpoint, flat_grad, recompute_backward,
                               reuse_backward)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


class ToyParts:
    """F(z; x) = tanh(W z + U x) with ‖W‖₂ = kappa < 1 (so ‖J‖₂ ≤ kappa); readout V z; float64."""

    def __init__(self, d: int = 6, n_in: int = 4, n_out: int = 5, kappa: float = 0.6, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(d, d, generator=g, dtype=torch.float64)
        w *= kappa / torch.linalg.matrix_norm(w, ord=2)
        self.W = torch.nn.Parameter(w)
        self.U = torch.nn.Parameter(torch.randn(d, n_in, generator=g, dtype=torch.float64))
        self.V = torch.nn.Parameter(torch.randn(n_out, d, generator=g, dtype=torch.float64))

    def parameters(self):
        return [self.W, self.U, self.V]

    def encode(self, x):
        return x @ self.U.T

    def init_state(self, e):
        return torch.zeros_like(e)

    def step(self, z, e):
        return torch.tanh(z @ self.W.T + e)

    def readout(self, z):
        return z @ self.V.T


def _toy_problem():
    parts = ToyParts()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 3, 1])

    def loss_fn(logits):
        return torch.nn.functional.cross_entropy(logits, y)

    return parts, x, loss_fn


def _zero(parts):
    for p in parts.parameters():
        p.grad = None


def _implicit_gradient(parts: ToyParts, x, loss_fn):
    """G = c + Bᵀ (I − Jᵀ)⁻¹ g at the fixed point, with J formed explicitly (float64)."""
    z_star = endpoint(parts, x, 400)
    with torch.no_grad():
        assert float((parts.step(z_star, parts.encode(x)) - z_star).abs().max()) < 1e-14
    n = z_star.numel()
    e = parts.encode(x).detach()
    J = torch.autograd.functional.jacobian(lambda z: parts.step(z.view_as(z_star), e).reshape(-1),
                                           z_star.reshape(-1))
    zs = z_star.clone().requires_grad_(True)
    loss = loss_fn(parts.readout(zs))
    grads = torch.autograd.grad(loss, [zs] + parts.parameters(), allow_unused=True)
    g, c = grads[0].reshape(-1), [torch.zeros_like(p) if gp is None else gp for p, gp in zip(parts.parameters(), grads[1:])]
    u = torch.linalg.solve(torch.eye(n, dtype=J.dtype) - J.T, g)
    out = parts.step(z_star, parts.encode(x))  # Bᵀu through one application (state held fixed)
    bu = torch.autograd.grad(out, parts.parameters(), u.view_as(out), allow_unused=True)
    total = [ci + (torch.zeros_like(ci) if b is None else b) for ci, b in zip(c, bu)]
    return torch.cat([t.reshape(-1) for t in total]), J, z_star


def test_neumann_converges_geometrically_to_implicit_gradient():
    parts, x, loss_fn = _toy_problem()
    g_imp, J, z_star = _implicit_gradient(parts, x, loss_fn)
    kappa = float(torch.linalg.matrix_norm(J, ord=2))
    rho = float(torch.linalg.eigvals(J).abs().max())
    assert kappa < 0.6 + 1e-12 and rho <= kappa
    errors = []
    for b in range(1, 17):
        _zero(parts)
        reuse_backward(parts, x, z_star, loss_fn, b)
        errors.append(float((flat_grad(parts.parameters()) - g_imp).norm()))
    rel = [e / float(g_imp.norm()) for e in errors]
    assert all(b2 < b1 for b1, b2 in zip(errors, errors[1:])), rel
    assert rel[-1] < 1e-5 and rel[0] > 1e-2
    # geometric decay at (or below) the contraction rate: mean ratio over b = 4..16
    rate = (errors[15] / errors[3]) ** (1 / 12)
    assert rate <= kappa + 1e-3, (rate, kappa, rho)
    assert abs(rate - rho) < 0.05, (rate, rho)  # asymptotically the spectral radius of J
    # every single step contracts too (not guaranteed in general; holds here with margin)
    ratios = [errors[i + 1] / errors[i] for i in range(3, 15)]
    assert max(ratios) < 0.9


def test_reuse_equals_full_bptt_at_converged_trajectory():
    parts, x, loss_fn = _toy_problem()
    g_imp, _, _ = _implicit_gradient(parts, x, loss_fn)
    R = 120
    _zero(parts)
    bptt_backward(parts, x, R, loss_fn)
    g_bptt = flat_grad(parts.parameters())
    _zero(parts)
    reuse_backward(parts, x, endpoint(parts, x, R), loss_fn, b=R)
    g_reuse = flat_grad(parts.parameters())
    scale = float(g_imp.norm())
    assert float((g_bptt - g_imp).norm()) / scale < 1e-10
    assert float((g_reuse - g_bptt).norm()) / scale < 1e-10
    _zero(parts)  # recompute = rebuild the endpoint, same backward
    recompute_backward(parts, x, R, loss_fn, b=R)
    assert float((flat_grad(parts.parameters()) - g_reuse).norm()) / scale < 1e-12


def test_truncated_bptt_window_is_exact_autograd():
    parts, x, loss_fn = _toy_problem()
    _zero(parts)
    bptt_backward(parts, x, 6, loss_fn, bptt_window=2)
    ours = flat_grad(parts.parameters())
    _zero(parts)
    e = parts.encode(x)
    z = parts.init_state(e)
    for r in range(6):
        z = parts.step(z.detach() if r == 4 else z, e)
    loss_fn(parts.readout(z)).backward()
    assert torch.allclose(ours, flat_grad(parts.parameters()), rtol=0, atol=1e-14)


def _contractive_hf(hidden: int = 32, seed: int = 0):
    """A tiny HF looped model whose core residual branches are scaled down (‖J‖ ≈ retention e⁻¹)."""
    from megaloop.hf.modeling_megaloop import MegaloopForCausalLM
    from tests.post.rl.helpers import tiny_config

    torch.manual_seed(seed)
    model = MegaloopForCausalLM(tiny_config(hidden_size=hidden, intermediate_size=64, vocab_size=64,
                                            tokenizer_vocab_size=64, tie_word_embeddings=True)).double().eval()
    with torch.no_grad():
        for layer in model.model.core:
            layer.self_attn.o_proj.weight.mul_(0.2)
            layer.mlp.down_proj.weight.mul_(0.2)
    return model


def test_hf_adapter_matches_model_and_reuse_matches_bptt_when_converged():
    model = _contractive_hf()
    parts = HFLoopedParts(model)
    assert isinstance(parts, LoopedParts)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # adapter = the model's own parallel forward
        ref = model(ids, use_cache=False, num_recurrences=4).logits
        assert torch.equal(parts.readout(endpoint(parts, ids, 4)), ref)
    y = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))

    def loss_fn(logits):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 64), y.reshape(-1))

    params = parts.parameters()
    R = 60
    model.zero_grad(set_to_none=True)
    bptt_backward(parts, ids, R, loss_fn)
    g_bptt = flat_grad(params)
    z_end = endpoint(parts, ids, R)
    errs = []
    for b in (1, 2, 4, 8, 16, R):
        model.zero_grad(set_to_none=True)
        st = reuse_backward(parts, ids, z_end, loss_fn, b)
        errs.append(float((flat_grad(params) - g_bptt).norm() / g_bptt.norm()))
    assert st.residual < 1e-12
    assert errs[-1] < 1e-9, errs
    assert all(b2 < b1 for b1, b2 in zip(errs, errs[1:])), errs
    # the prelude and embedding learn through e (B includes the injection path)
    assert model.model.prelude[0].mlp.up_proj.weight.grad.abs().sum() > 0


def test_update_memory_independent_of_depth():
    model = _contractive_hf().float()
    parts = HFLoopedParts(model)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))

    def loss_fn(logits):
        return logits.float().logsumexp(-1).mean()

    saved = {}
    for R in (2, 8):
        z_end = endpoint(parts, ids, R)
        for arm, run in (("reuse", lambda: reuse_backward(parts, ids, z_end, loss_fn, 4)),
                         ("recompute", lambda: recompute_backward(parts, ids, R, loss_fn, 4)),
                         ("bptt", lambda: bptt_backward(parts, ids, R, loss_fn))):
            model.zero_grad(set_to_none=True)
            with SavedTensorMeter(exclude=parts.parameters()) as meter:
                run()
            saved[(arm, R)] = meter.bytes
    assert saved[("reuse", 2)] == saved[("reuse", 8)]
    assert saved[("recompute", 8)] == saved[("reuse", 8)]
    assert saved[("bptt", 8)] > 2.5 * saved[("bptt", 2)]
    assert saved[("bptt", 8)] > 2 * saved[("reuse", 8)]


def test_native_adapter(megatron_world):
    from megaloop.model.config import ModelConfig
    from megaloop.model.looped import LoopedGPT
    from megaloop.model.specs import transformer_config
    from megaloop.post.rl.parts import NativeLoopedParts, looped_parts

    cfg = ModelConfig(hidden_size=32, num_heads=2, seq_len=8, injection="parcae_nonorm")
    model = LoopedGPT(cfg, transformer_config(cfg, tp=1, pp=1, vpp=None, sequence_parallel=False),
                      vocab_size=64, seed=3).eval()
    parts = looped_parts(model)
    assert isinstance(parts, NativeLoopedParts)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids, depth=5)
        ours = parts.readout(endpoint(parts, ids, 5))
    assert torch.allclose(ours, ref, atol=1e-6, rtol=1e-6)

    def loss_fn(logits):
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids.reshape(-1))

    params = parts.parameters()
    model.zero_grad(set_to_none=True)
    bptt_backward(parts, ids, 5, loss_fn)
    g_bptt = flat_grad(params)
    model.zero_grad(set_to_none=True)
    reuse_backward(parts, ids, endpoint(parts, ids, 5), loss_fn, 5)
    g_reuse = flat_grad(params)
    assert torch.isfinite(g_reuse).all() and g_reuse.norm() > 0
    assert cosine(g_reuse, g_bptt) > 0.5  # untrained model: the same direction, not the same gradient
    assert any(float(p.grad.abs().sum()) > 0 for n, p in model.named_parameters()
               if n.startswith("prelude") and p.grad is not None)
