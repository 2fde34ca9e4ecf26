"""Injection variants: OrthoInj projection, Parcae retention init, shapes (SPEC §2)."""

import math

import pytest
import torch

from megaloop.model.injection import ParcaeDiagonal, inverse_softplus, project_out


def _cfg(d=16):
    from megaloop.model.config import ModelConfig
    from megaloop.model.specs import transformer_config

    return transformer_config(ModelConfig(hidden_size=d, num_heads=2, seq_len=8), tp=1, pp=1, vpp=None,
                              sequence_parallel=False)


def test_inverse_softplus_roundtrip():
    for y in (0.1, 1.0, 0.5 * math.log(5), 7.0):
        assert abs(math.log1p(math.exp(inverse_softplus(y))) - y) < 1e-12


def test_parcae_decay_retention_is_one_over_sqrt5(megatron_world):
    inj = ParcaeDiagonal(_cfg(), "parcae_decay")
    lam = inj.retention().double()
    assert torch.allclose(lam, torch.full_like(lam, 5 ** -0.5), rtol=0, atol=1e-6)
    nonorm = ParcaeDiagonal(_cfg(), "parcae_nonorm")
    assert torch.allclose(nonorm.delta().double(), torch.ones(16, dtype=torch.float64), atol=1e-6)
    assert torch.equal(inj.proj.data, torch.eye(16))


def test_orthoinj_component_along_q_is_q():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(5, 3, 16, generator=g, dtype=torch.float64)
    q = torch.randn(5, 3, 16, generator=g, dtype=torch.float64)
    lam = torch.rand(16, generator=g, dtype=torch.float64)
    zeta = project_out(lam * h, q, eps=0.0) + q
    along = (zeta * q).sum(-1) / (q * q).sum(-1)
    assert torch.allclose(along, torch.ones_like(along), atol=1e-12)


def test_orthoinj_projected_carry_is_contractive():
    g = torch.Generator().manual_seed(1)
    d = 12
    q = torch.randn(d, generator=g, dtype=torch.float64)
    lam = torch.rand(d, generator=g, dtype=torch.float64) * 0.999
    Q = torch.eye(d, dtype=torch.float64) - torch.outer(q, q) / (q @ q)
    norm = torch.linalg.matrix_norm(Q @ torch.diag(lam), ord=2)
    assert norm <= torch.linalg.matrix_norm(torch.diag(lam), ord=2) + 1e-12
    assert norm < 1.0
    # the module's FP32 projection agrees with the explicit matrix
    v = torch.randn(d, generator=g, dtype=torch.float64)
    ours = project_out((lam * v).view(1, 1, d).float(), q.view(1, 1, d).float(), eps=1e-6).double().view(d)
    assert torch.allclose(ours, Q @ (lam * v), atol=1e-5)


def test_orthoinj_module_forward_keeps_q(megatron_world):
    inj = ParcaeDiagonal(_cfg(), "orthoinj", ortho_eps=0.0)
    e = torch.randn(4, 2, 16)
    h = torch.randn(4, 2, 16)
    ctx = inj.prepare(e)
    zeta = inj(h, ctx)
    q = ctx["q"]
    along = (zeta.double() * q.double()).sum(-1) / (q.double() ** 2).sum(-1)
    assert torch.allclose(along, torch.ones_like(along), atol=1e-5)


def test_huginn_exit_norm_switch(megatron_world):
    """model.exit_norm=false (the paper's diagnostic) makes the core exit the identity; the default
    normalises each token to unit RMS."""
    from megaloop.model.injection import HuginnLinear

    h = torch.randn(4, 2, 16) * 3.0
    normed = HuginnLinear(_cfg(), exit_norm=True).exit(h)
    assert torch.allclose(normed.pow(2).mean(-1), torch.ones(4, 2), atol=1e-4)
    assert torch.equal(HuginnLinear(_cfg(), exit_norm=False).exit(h), h)


def test_exit_norm_only_for_huginn():
    import pytest

    from megaloop.config_utils import ConfigError
    from megaloop.model.config import ModelConfig

    with pytest.raises(ConfigError, match="model.exit_norm"):
        ModelConfig(injection="parcae_nonorm", exit_norm=False)
    ModelConfig(injection="huginn_linear", exit_norm=False)


def test_orthoinj_early_projects_against_e(megatron_world):
    """The earlier OrthoInj: Δ₀ = 1 and the carry-over projected orthogonally to the raw input e."""
    inj = ParcaeDiagonal(_cfg(), "orthoinj_early", ortho_eps=0.0)
    assert torch.allclose(inj.delta().double(), torch.ones(16, dtype=torch.float64), atol=1e-6)
    with torch.no_grad():
        inj.proj.copy_(torch.randn(16, 16))  # so that q and e point in different directions
    e, h = torch.randn(4, 2, 16, dtype=torch.float32), torch.randn(4, 2, 16)
    ctx = inj.prepare(e)
    carry = inj(h, ctx) - ctx["q"]
    along_e = (carry.double() * e.double()).sum(-1) / (e.double() ** 2).sum(-1)
    assert along_e.abs().max() < 1e-5
    along_q = (carry.double() * ctx["q"].double()).sum(-1).abs()
    assert along_q.max() > 1e-3  # not the q-projection of `orthoinj`


def test_huginn_adapter_init_and_bias_options(megatron_world):
    """``model.adapter_init=normal`` initialises W_in like every other matrix (std init_std) and
    ``adapter_bias=false`` drops the bias (Huginn's code); the default is torch's Linear init with a
    bias (the recipe's); other injections refuse the options."""
    from megaloop.config_utils import ConfigError
    from megaloop.model.config import ModelConfig
    from megaloop.model.looped import LoopedGPT
    from megaloop.model.specs import transformer_config

    def adapter(**kw):
        cfg = ModelConfig(hidden_size=64, num_heads=4, seq_len=8, injection="huginn_linear", **kw)
        m = LoopedGPT(cfg, transformer_config(cfg, tp=1, pp=1, vpp=None, sequence_parallel=False),
                      vocab_size=64, seed=3)
        return cfg, m.injection.adapter

    cfg, ref = adapter(adapter_init="normal", adapter_bias=False)
    w = ref.weight.detach()
    assert ref.bias is None and w.shape == (64, 128)
    assert abs(float(w.std()) - cfg.init_std_value) < 0.05 * cfg.init_std_value
    assert float(adapter(adapter_init="normal")[1].bias.detach().abs().max()) == 0.0  # as the HF init
    _, default = adapter()
    bound = 1.0 / 128 ** 0.5  # torch's kaiming-uniform bound for fan_in 2d
    assert default.bias is not None and float(default.weight.detach().abs().max()) <= bound
    assert abs(float(default.weight.detach().std()) - bound / 3 ** 0.5) < 0.05 * bound
    with pytest.raises(ConfigError, match="model.adapter_init"):
        ModelConfig(injection="parcae_nonorm", adapter_bias=False)
    with pytest.raises(ConfigError, match="model.adapter_init"):
        ModelConfig(injection="huginn_linear", adapter_init="xavier")
