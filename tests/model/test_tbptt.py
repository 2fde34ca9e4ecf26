"""Truncated BPTT (SPEC §3): gradients equal autograd of the truncated objective."""

import pytest
import torch

from megaloop.model.config import ModelConfig
from megaloop.model.looped import LoopedGPT
from megaloop.model.specs import transformer_config


def _model(injection="parcae_nonorm", **extra):
    cfg = ModelConfig(hidden_size=32, num_heads=2, seq_len=8, injection=injection, bptt_window=10, **extra)
    tc = transformer_config(cfg, tp=1, pp=1, vpp=None, sequence_parallel=False)
    return LoopedGPT(cfg, tc, vocab_size=64, seed=3)


def _grads(model):
    return {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}


def _reference_loss(model, ids, labels, depth, window, seed):
    """Full-graph forward of every recurrence, with the state detached at r − b by hand."""
    x = model.embedding(input_ids=ids, position_ids=None) * model.cfg.embedding_multiplier  # embed_scale
    e = model.prelude(x, model.rope(ids.shape[1]))
    rope = model.rope(ids.shape[1])
    h = model.init_state(e, seed)
    ctx = model.injection.prepare(e)
    for i in range(depth):
        if i == depth - window:
            h = h.detach()
        h = model.recur(h, e, ctx, rope)
    h = model.final_norm(model.coda(h, rope))
    logits, _ = model.output_layer(h)
    return model.compute_language_model_loss(labels, logits).sum()


@pytest.mark.parametrize("injection", ["parcae_nonorm", "huginn_linear", "orthoinj", "deq_qkv"])
def test_truncated_gradients_match_autograd(megatron_world, injection):
    model = _model(injection)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    depth, window = 6, 2
    model(ids, labels=ids, depth=depth, bptt_window=window, noise_seed=5).sum().backward()
    ours = _grads(model)
    model.zero_grad()
    _reference_loss(model, ids, ids, depth, window, 5).backward()
    ref = _grads(model)
    for n in ref:
        assert (ours[n] is None) == (ref[n] is None), n
        if ref[n] is not None:
            assert torch.allclose(ours[n], ref[n], rtol=1e-5, atol=1e-7), n
    # the prelude still learns through the injected e
    assert ours["prelude.0.mlp.linear_fc1.weight"].abs().sum() > 0


def test_prefix_only_parameters_get_no_gradient(megatron_world):
    """A parameter that acts only in recurrence 0 gets a gradient iff b = r."""
    model = _model()
    probe = torch.nn.Parameter(torch.zeros(()))
    calls = {"n": 0}
    recur = model.recur

    def probed(h, e, ctx, rope):
        out = recur(h, e, ctx, rope)
        if calls["n"] == 0:
            out = out + probe
        calls["n"] += 1
        return out

    model.recur = probed
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    model(ids, labels=ids, depth=5, bptt_window=2, noise_seed=1).sum().backward()
    assert probe.grad is None or probe.grad.abs().item() == 0.0
    calls["n"] = 0
    model(ids, labels=ids, depth=5, bptt_window=5, noise_seed=1).sum().backward()
    assert probe.grad is not None and probe.grad.abs().item() > 0


def test_window_never_exceeds_depth(megatron_world):
    model = _model()
    ids = torch.randint(0, 64, (1, 8))
    loss_a = model(ids, labels=ids, depth=3, bptt_window=10, noise_seed=2)
    loss_b = model(ids, labels=ids, depth=3, bptt_window=3, noise_seed=2)
    assert torch.equal(loss_a, loss_b)
    with pytest.raises(ValueError, match="depth"):
        model(ids, labels=ids, depth=0)


@pytest.mark.parametrize("injection,extra", [("parcae_decay", {}), ("parcae_nonorm", {}), ("huginn_linear", {}),
                                             ("deq_qkv", {}), ("huginn_linear", {"qk_bias": True, "num_query_groups": 1}),
                                             ("parcae_decay", {"state_readout": True, "qk_bias": True}),
                                             ("huginn_linear", {"adapter_bias": False})])
def test_param_count_matches_built_model(megatron_world, injection, extra):
    from megaloop.model.config import param_count

    model = _model(injection, **extra)
    counted = param_count(model.cfg, 64)["total"]
    assert counted == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("injection", ["parcae_nonorm", "deq_qkv"])
def test_recompute_gives_the_same_gradients(megatron_world, injection):
    """model.recompute (activation checkpointing of every layer visit) changes memory, not maths;
    DEQ-QKV's injected e is a checkpoint input, so the recomputed forward sees it too."""
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    grads, losses = [], []
    for recompute in (False, True):
        cfg = ModelConfig(hidden_size=32, num_heads=2, seq_len=8, injection=injection, bptt_window=10,
                          recompute=recompute)
        model = LoopedGPT(cfg, transformer_config(cfg, tp=1, pp=1, vpp=None, sequence_parallel=False),
                          vocab_size=64, seed=3)
        loss = model(ids, labels=ids, depth=5, bptt_window=3, noise_seed=7).sum()
        loss.backward()
        losses.append(loss.item())
        grads.append(_grads(model))
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    for n, g in grads[0].items():
        assert (g is None) == (grads[1][n] is None), n
        if g is not None:
            assert torch.allclose(g, grads[1][n], rtol=1e-5, atol=1e-7), n
    assert grads[1]["core.0.self_attention.linear_qkv.weight"].abs().sum() > 0


def test_recompute_with_fp8_is_refused():
    from megaloop.config_utils import ConfigError

    with pytest.raises(ConfigError, match="model.recompute"):
        ModelConfig(hidden_size=32, num_heads=2, recompute=True, fp8="hybrid")
