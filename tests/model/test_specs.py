"""Layer specs: the SDPA core attention equals megatron's explicit-scores attention."""

import pytest
import torch

from megaloop.model.config import ModelConfig
from megaloop.model.looped import LoopedGPT
from megaloop.model.specs import SDPACoreAttention, transformer_config


def _model(attention: str, groups: int | None):
    cfg = ModelConfig(hidden_size=64, num_heads=4, num_query_groups=groups, seq_len=16,
                      injection="deq_qkv", local_attention=attention)
    return LoopedGPT(cfg, transformer_config(cfg, tp=1, pp=1, vpp=None, sequence_parallel=False),
                     vocab_size=128, seed=11)


@pytest.mark.parametrize("groups", [None, 2, 1])  # MHA, GQA, MQA
def test_sdpa_attention_matches_megatron_attention(megatron_world, groups):
    ids = torch.randint(0, 128, (3, 16), generator=torch.Generator().manual_seed(2))
    out, grads = {}, {}
    for attention in ("sdpa", "megatron"):
        model = _model(attention, groups)
        uses_sdpa = isinstance(next(iter(model.core)).self_attention.core_attention, SDPACoreAttention)
        assert uses_sdpa == (attention == "sdpa")
        loss = model(ids, labels=ids, depth=4, bptt_window=2, noise_seed=3)
        loss.sum().backward()
        out[attention] = loss.detach()
        grads[attention] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    torch.testing.assert_close(out["sdpa"], out["megatron"], rtol=1e-5, atol=1e-5)
    assert grads["sdpa"].keys() == grads["megatron"].keys()
    for n, g in grads["sdpa"].items():
        # atol relative to the tensor's scale (gradients reach ~5 with the √d embedding scale)
        scale = max(1.0, float(grads["megatron"][n].abs().max()))
        torch.testing.assert_close(g, grads["megatron"][n], rtol=1e-4, atol=1e-6 * scale, msg=n)


def test_unknown_local_attention_is_refused():
    from megaloop.config_utils import ConfigError

    with pytest.raises(ConfigError, match="model.local_attention"):
        ModelConfig(hidden_size=32, num_heads=2, local_attention="flash")


def test_fp8_settings_are_validated_before_compute():
    from megaloop.config_utils import ConfigError

    with pytest.raises(ConfigError, match="model.fp8_recipe"):
        ModelConfig(hidden_size=32, num_heads=2, fp8_recipe="bogus")
    with pytest.raises(ConfigError, match="model.fp8: hidden_size 40"):
        ModelConfig(hidden_size=40, num_heads=2, fp8="hybrid")
    with pytest.raises(ConfigError, match="model.fp8: FP8 needs Transformer Engine"):  # no TE/CUDA here
        transformer_config(ModelConfig(hidden_size=32, num_heads=2, fp8="hybrid"), tp=1, pp=1, vpp=None,
                           sequence_parallel=False)
    from megaloop.config import RunConfig, TrainConfig

    with pytest.raises(ConfigError, match="model.fp8: tokens per microbatch"):
        RunConfig(model=ModelConfig(hidden_size=32, num_heads=2, seq_len=9, fp8="hybrid"),
                  train=TrainConfig(global_batch_size=1, micro_batch_size=1))


def _assert_scaled_orthogonal(w: torch.Tensor, std: float, name: str) -> None:
    """WᵀW (tall) or WWᵀ (wide) equals gain²·I with gain = std·√max(rows, cols) (float64 ``w``)."""
    rows, cols = w.shape
    gram = w.T @ w if rows >= cols else w @ w.T
    gain2 = std * std * max(rows, cols)
    torch.testing.assert_close(gram, gain2 * torch.eye(min(rows, cols), dtype=torch.double),
                               rtol=0, atol=1e-6 * gain2, msg=name)


@pytest.mark.parametrize("out_init_std", [None, 0.0, 0.01])
def test_orthogonal_init_gives_scaled_orthogonal_matrices(megatron_world, out_init_std):
    """``model.init_orthogonal``: every weight matrix is orthogonal (WᵀW or WWᵀ = gain²·I, gain =
    std·√max(rows, cols)) at the normal init's per-entry std; zero-init outputs stay zero."""
    cfg = ModelConfig(hidden_size=64, num_heads=4, seq_len=16, init_orthogonal=True, out_init_std=out_init_std,
                      tie_embeddings=False, state_readout=True)
    model = LoopedGPT(cfg, transformer_config(cfg, tp=1, pp=1, vpp=None, sequence_parallel=False),
                      vocab_size=128, seed=11)
    std = cfg.init_std_value
    out_std = std / (2.0 * cfg.physical_layers) ** 0.5 if out_init_std is None else out_init_std
    seen = set()
    for name, p in model.named_parameters():
        if p.dim() != 2 or "injection" in name:
            continue
        w = p.detach().double()
        kind = ("out" if name.endswith(("linear_proj.weight", "linear_fc2.weight")) else "in")
        s = out_std if kind == "out" else std
        seen.add(kind)
        if s == 0.0:
            assert torch.count_nonzero(w) == 0, name
            continue
        _assert_scaled_orthogonal(w, s, name)
        assert abs(float(w.std()) - s) < 0.1 * s, name  # same per-entry scale as the normal init
    assert seen == {"in", "out"}


@pytest.mark.parametrize("groups", [None, 2])
def test_qkv_init_split_gives_separate_orthogonal_q_k_v(megatron_world, groups):
    """``model.qkv_init_split``: un-interleaving megatron's per-group QKV layout gives three matrices
    q [heads·hd, d], k, v [groups·hd, d], each orthogonal at gain std·√max(rows, cols); the fused
    matrix is not (q and k overlap), unlike plain ``init_orthogonal``. Refused without init_orthogonal."""
    from megaloop.config_utils import ConfigError

    with pytest.raises(ConfigError, match="model.qkv_init_split"):
        ModelConfig(qkv_init_split=True)
    cfg = ModelConfig(hidden_size=64, num_heads=4, num_query_groups=groups, seq_len=16, init_orthogonal=True,
                      qkv_init_split=True)
    model = LoopedGPT(cfg, transformer_config(cfg, tp=1, pp=1, vpp=None, sequence_parallel=False),
                      vocab_size=128, seed=11)
    ng, hd, d, std = cfg.groups, 16, 64, cfg.init_std_value
    per = 4 // ng
    qkvs = [p.detach().double() for n, p in model.named_parameters() if n.endswith("linear_qkv.weight")]
    assert len(qkvs) == cfg.physical_layers
    for w in qkvs:
        blocks = w.view(ng, (per + 2) * hd, d)
        q = blocks[:, :per * hd].reshape(-1, d)
        k, v = blocks[:, per * hd:(per + 1) * hd].reshape(-1, d), blocks[:, (per + 1) * hd:].reshape(-1, d)
        for part, m in zip("qkv", (q, k, v)):
            _assert_scaled_orthogonal(m, std, part)
        assert float((q @ k.T).abs().max()) > 1e-3  # separate draws: q and k are not mutually orthogonal


def test_state_readout_applies_c_before_the_coda(megatron_world):
    """``model.state_readout``: logits = head(norm(coda(C h^R))). With C = I the model equals the same
    weights without a readout; with any C it equals running the coda on C h by hand. C takes no
    weight decay and is initialised at the weight init's scale."""
    from megaloop.config_utils import ConfigError

    kw = dict(hidden_size=64, num_heads=4, seq_len=16, n_prelude=1, n_core=2, n_coda=1)
    with_c = LoopedGPT(ModelConfig(state_readout=True, **kw),
                       transformer_config(ModelConfig(state_readout=True, **kw), tp=1, pp=1, vpp=None,
                                          sequence_parallel=False), vocab_size=128, seed=11).eval()
    plain_cfg = ModelConfig(**kw)
    plain = LoopedGPT(plain_cfg, transformer_config(plain_cfg, tp=1, pp=1, vpp=None, sequence_parallel=False),
                      vocab_size=128, seed=11).eval()
    c = with_c.state_readout.weight
    assert c.shape == (64, 64) and c.no_weight_decay is True
    assert abs(float(c.detach().std()) - with_c.cfg.init_std_value) < 0.1 * with_c.cfg.init_std_value
    missing = plain.load_state_dict(with_c.state_dict(), strict=False)
    assert missing.unexpected_keys == ["state_readout.weight"] and not missing.missing_keys
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        e = with_c.encode(ids)
        h = with_c.run_recurrences(with_c.init_state(e, None), e, 0, 3, 3, 3, with_c.rope(16))
        by_hand = plain.readout(h @ c.T)  # plain: coda -> norm -> head
        torch.testing.assert_close(with_c(ids, depth=3), by_hand, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(with_c.readout(h), by_hand, rtol=1e-5, atol=1e-5)
        assert (with_c(ids, depth=3) - plain(ids, depth=3)).abs().max() > 1e-2  # C matters
        c.copy_(torch.eye(64))
        torch.testing.assert_close(with_c(ids, depth=3), plain(ids, depth=3), rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match="model.state_readout"):
        ModelConfig(arch="untied", state_readout=True)


def test_state_final_norm_normalises_the_state_with_the_final_norm(megatron_world):
    """``model.state_final_norm`` (Huginn's ln_f on h^R): logits = head(g⊙N(coda(C·g⊙N(h^R)))) with
    the one final-norm gain g; no new parameters (the state dict equals the plain model's); training
    gives the gain a finite gradient; refused for arch=untied."""
    from megaloop.config_utils import ConfigError

    kw = dict(hidden_size=64, num_heads=4, seq_len=16, n_prelude=1, n_core=2, n_coda=1, state_readout=True)
    cfg = ModelConfig(state_final_norm=True, **kw)
    normed = LoopedGPT(cfg, transformer_config(cfg, tp=1, pp=1, vpp=None, sequence_parallel=False),
                       vocab_size=128, seed=11).eval()
    plain_cfg = ModelConfig(**kw)
    plain = LoopedGPT(plain_cfg, transformer_config(plain_cfg, tp=1, pp=1, vpp=None, sequence_parallel=False),
                      vocab_size=128, seed=11).eval()
    assert plain.load_state_dict(normed.state_dict(), strict=True) is not None  # same parameters
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    g = normed.final_norm.weight
    with torch.no_grad():
        g.copy_(1.0 + 0.3 * torch.randn(64, generator=torch.Generator().manual_seed(4)))
        plain.final_norm.weight.copy_(g)
        e = normed.encode(ids)
        h = 3.0 * normed.run_recurrences(normed.init_state(e, None), e, 0, 3, 3, 3, normed.rope(16))
        n = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * g
        torch.testing.assert_close(normed.readout(h), plain.readout(n), rtol=1e-5, atol=1e-5)
        assert (normed(ids, depth=3) - plain(ids, depth=3)).abs().max() > 1e-2  # the norm matters
    normed.train()
    normed(ids, labels=ids, depth=2, bptt_window=2).sum().backward()
    g_total = g.grad.clone()
    assert torch.isfinite(g_total).all() and g_total.abs().sum() > 0
    with pytest.raises(ConfigError, match="model.state_final_norm"):
        ModelConfig(arch="untied", state_final_norm=True)


def test_qk_bias_adds_per_head_biases_before_rope(megatron_world):
    """``model.qk_bias``: zero-initialised (the model equals the same weights without biases), added
    head by head to the projected queries and keys (GQA: one key bias per group) before RoPE, no
    weight decay; a TP degree that does not split the key groups is refused."""
    from megaloop.config_utils import ConfigError

    kw = dict(hidden_size=64, num_heads=4, num_query_groups=2, seq_len=16, n_prelude=1, n_core=2, n_coda=1)

    def build(**extra):
        cfg = ModelConfig(**kw, **extra)
        return LoopedGPT(cfg, transformer_config(cfg, tp=1, pp=1, vpp=None, sequence_parallel=False),
                         vocab_size=128, seed=11).eval()

    biased, plain = build(qk_bias=True), build()
    attn = biased.core._modules["0"].self_attention
    assert attn.q_bias.shape == (4, 16) and attn.k_bias.shape == (2, 16)
    assert attn.q_bias.no_weight_decay and attn.q_bias.tensor_model_parallel
    res = plain.load_state_dict(biased.state_dict(), strict=False)
    assert sorted(res.unexpected_keys) == sorted(f"{g}.{i}.self_attention.{n}_bias" for g, i in
                                                 (("prelude", 0), ("core", 0), ("core", 1), ("coda", 0))
                                                 for n in "qk") and not res.missing_keys
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(biased(ids, depth=3), plain(ids, depth=3), rtol=1e-5, atol=1e-5)
        x = torch.randn(16, 2, 64, generator=torch.Generator().manual_seed(4))
        qb, kb = torch.randn(4, 16), torch.randn(2, 16)
        attn.q_bias.copy_(qb)
        attn.k_bias.copy_(kb)
        q, k, v = attn.get_query_key_value_tensors(x)
        q0, k0, v0 = plain.core._modules["0"].self_attention.get_query_key_value_tensors(x)
        torch.testing.assert_close(q, q0 + qb)  # [s, b, heads, hd] + [heads, hd]
        torch.testing.assert_close(k, k0 + kb)
        torch.testing.assert_close(v, v0)
        assert (biased(ids, depth=3) - plain(ids, depth=3)).abs().max() > 1e-3
    with pytest.raises(ConfigError, match="model.qk_bias"):
        ModelConfig(**kw, qk_bias=True).validate_parallel(4, False)


def test_qk_norm_gain_false_keeps_gains_at_one_through_training(megatron_world, tmp_path):
    """``model.qk_norm_gain=false`` (Parcae's weightless QK RMSNorm): the gains exist (same state-dict
    layout), equal 1, take no gradient and no optimizer update, so the model equals the learned-gain
    model at init and the weightless ``F.rms_norm`` of q and k throughout; the TE spec and a missing
    ``qk_norm`` are refused naming the field."""
    from megaloop.config import load_config
    from megaloop.config_utils import ConfigError
    from megaloop.model.build import unwrap
    from megaloop.train.trainer import Trainer

    kw = dict(hidden_size=64, num_heads=4, seq_len=16, n_prelude=1, n_core=2, n_coda=1, qk_norm=True)
    built = {}
    for gain in (True, False):
        cfg = ModelConfig(**kw, qk_norm_gain=gain)
        built[gain] = LoopedGPT(cfg, transformer_config(cfg, tp=1, pp=1, vpp=None, sequence_parallel=False),
                                vocab_size=128, seed=11).eval()
    assert built[True].state_dict().keys() == built[False].state_dict().keys()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(built[False](ids, depth=3), built[True](ids, depth=3), rtol=0, atol=0)
    with pytest.raises(ConfigError, match="model.qk_norm_gain"):
        ModelConfig(qk_norm=False, qk_norm_gain=False)

    t = Trainer(load_config("tiny", ["model.qk_norm=true", "model.qk_norm_gain=false", "train.max_steps=3",
                                     "train.global_batch_size=4", "train.micro_batch_size=2",
                                     "optim.warmup_steps=1", "logging.progress=false",
                                     "train.eval_interval=0", "train.save_interval=0"]), tmp_path / "run")
    t.setup()
    model = unwrap(t.model[0])
    gains = {n: p for n, p in model.named_parameters() if "q_layernorm" in n or "k_layernorm" in n}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert len(gains) == 8 and not any(p.requires_grad for p in gains.values())  # 4 layers x (q, k)
    for _ in range(3):
        t.train_step()
    t.loader.close()
    for n, p in model.named_parameters():
        if n in gains:
            assert torch.equal(p.detach(), torch.ones_like(p)), n
        elif n.endswith("input_layernorm.weight"):
            assert not torch.equal(p.detach(), before[n]), n  # the other norms' gains do train
