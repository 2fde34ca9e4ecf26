"""Memory model terms on a hand-computed tiny config (d=128, 4 heads, SwiGLU 384, 1/2/1 layers,
s=128, micro-batch 8, bptt_window 4, vocab 4096, fp32) and the structure of pipeline peaks."""

from __future__ import annotations

import pytest

from megaloop.config import load_config
from megaloop.model.config import param_count
from megaloop.plan.cluster import ClusterSpec
from megaloop.plan.layout import make_layout
from megaloop.plan.memory import MemoryModel, stage_params
from megaloop.plan.stages import stage_work

CPU = ClusterSpec(name="cpu", activation_profile="local", reserved_gib=0.0, fragmentation=1.0)
V = 4096


def _mm(overrides=(), world=1, cluster=CPU) -> MemoryModel:
    cfg = load_config("tiny", ["model.qk_norm=false", "depth.kind=fixed", "depth.depth=4", *overrides])
    return MemoryModel(cfg, make_layout(cfg, world), cluster, V)


def test_parameter_counts_match_the_projects_count() -> None:
    mm = _mm()
    total = param_count(mm.cfg.model, V)["total"]
    assert sum(sum(p.values()) for p in mm.stage_params) == total == 1_918_336
    # PP=4: every stage holds a core replica (2 layers of 213,248 + the injection's d^2 + 2d)
    cfg = load_config("tiny", ["model.qk_norm=false", "parallel.pp=4", "train.global_batch_size=32"])
    st = stage_params(cfg, make_layout(cfg, 4), V)
    core = 2 * 213_248 + 128 * 128 + 2 * 128
    assert sum(sum(p.values()) for p in st) == total + 3 * core
    # the optional pieces: QK biases in every layer, readout C on the last stage
    extra = ["model.qk_norm=false", "parallel.pp=4", "train.global_batch_size=32", "model.qk_bias=true",
             "model.state_readout=true"]
    cfg = load_config("tiny", extra)
    st = stage_params(cfg, make_layout(cfg, 4), V)
    total = param_count(cfg.model, V)["total"]
    assert total == 1_918_336 + 4 * 256 + 128 * 128
    assert sum(sum(p.values()) for p in st) == total + 3 * (core + 2 * 256)


def test_static_bytes_by_hand() -> None:
    n = 1_918_336
    st = _mm(["parallel.distributed_optimizer=false"]).static(0)
    assert (st["params"], st["grads"], st["optimizer"]) == (4 * n, 4 * n, 8 * n)  # fp32 + Adam
    st = _mm(["model.bf16=true", "train.micro_batch_size=2"], world=4).static(0)  # DP=4, distributed optimizer
    assert (st["params"], st["grads"], st["optimizer"]) == (2 * n, 4 * n, 12 * n / 4)


def test_activations_by_hand() -> None:
    mm = _mm()
    # one layer visit, fp32 local profile: 20d+8 replicated + 16d+12kv+20f+4h TP-split bytes per token
    assert mm.layer_bytes() == (20 * 128 + 8) + (16 * 128 + 12 * 128 + 20 * 384 + 4 * 4) == 13_848
    per_token = (10 * 13_848  # 4 backpropagated recurrences x 2 core layers + prelude + coda
                 + 4 * 4 * 128  # injection keeps h per recurrence
                 + 4 * 128 + 8  # prepared injection input, token ids
                 + 12 * 128 + 4  # final norm
                 + 4 * 4096 + 9)  # fp32 softmax of the cross-entropy, labels and mask
    rope = 10 * 4 * 128 * 32 * 4  # cos/sin tables per visit
    assert mm.held(0, 4) == 1024 * per_token + rope == 163_451_904
    assert mm.transient("F", 0, 4) == 1024 * 4 * (3 * 128 + 4 * 384)  # one layer's working set
    # backward: the head's weight gradient first; the layers' gradient buffers come after the head's
    # saved softmax is freed, so on this single stage the head's transient is the larger
    layer_bwd = 1024 * 4 * (2 * 128 + 4 * 384) + 2 * 384 * 128 * 4
    head_saved = 1024 * (12 * 128 + 4 + 4 * 4096 + 9)
    assert mm.transient("B", 0, 4) == max(4096 * 128 * 4, layer_bwd - head_saved) == 4096 * 128 * 4
    pp2 = _mm(["parallel.pp=2", "train.global_batch_size=16"], world=2)
    assert pp2.transient("B", 0, 4) == layer_bwd + 1024 * 2 * 4 * 128  # + the [2s, b, d] output gradient


def test_qk_norm_terms_by_hand() -> None:
    """QK-norm (the default): 2·head_dim replicated gains per layer; per token and layer visit the
    norms keep q and k (fp32 on CPU, also for bf16 inputs; TE: the input's dtype) and an fp32 rstd
    per head and KV group."""
    qk = _mm(["model.qk_norm=true"])
    total = param_count(qk.cfg.model, V)["total"]
    assert sum(sum(p.values()) for p in qk.stage_params) == total == 1_918_336 + 4 * 2 * 32
    assert qk.layer_bytes() - _mm().layer_bytes() == 4 * (128 + 128) + 4 * (4 + 4) == 1056
    bf16 = ["model.bf16=true"]
    assert _mm([*bf16, "model.qk_norm=true"]).layer_bytes() - _mm(bf16).layer_bytes() == 8 * 256 + 32
    te = ClusterSpec(name="gpu", activation_profile="te", reserved_gib=0.0, fragmentation=1.0)
    assert (_mm([*bf16, "model.qk_norm=true"], cluster=te).layer_bytes()
            - _mm(bf16, cluster=te).layer_bytes()) == 2 * 256 + 32
    tp2 = _mm(["model.qk_norm=true", "parallel.tp=2"], world=2)
    assert tp2.layer_bytes() - _mm(["parallel.tp=2"], world=2).layer_bytes() == 1056 / 2


def test_flat_in_depth_and_split_by_tp() -> None:
    mm = _mm()
    assert mm.held(0, 4) == mm.held(0, 9) == mm.held(0, 64)  # the TBPTT window (bptt_window 4) only
    assert mm.held(0, 2) < mm.held(0, 4)
    tp2 = _mm(["parallel.tp=2"], world=2)
    assert tp2.layer_bytes() == 2568 + 11_280 / 2
    sp = _mm(["parallel.tp=2", "parallel.sequence_parallel=true"], world=2)
    assert sp.layer_bytes() == 13_848 / 2
    assert _mm(["model.recompute=true"]).layer_bytes() == 4 * 128


def test_one_f_one_b_in_flight_counts() -> None:
    mm = _mm(["parallel.pp=4", "train.global_batch_size=64"], world=4)
    assert mm.layout.microbatches == 8
    for k in range(4):
        peak = mm.rank_peak(k, [4] * 8)
        assert peak["in_flight"] == 4 - k  # rank k keeps pp - k microbatches before its first backward
        assert peak["activations"] == pytest.approx((4 - k) * mm.held(k, 4))


def test_worst_case_bounds_sampled_steps() -> None:
    cfg = load_config("tiny", ["parallel.pp=4", "parallel.vpp=2", "depth.kind=pln", "depth.mean=5",
                               "depth.cap=64", "train.global_batch_size=64"])
    layout = make_layout(cfg, 4)
    mm = MemoryModel(cfg, layout, CPU, V)
    from megaloop.plan.layout import depth_plans, depth_support

    support = depth_support(cfg)
    assert support == list(range(1, 65))
    for k in range(4):
        worst = mm.rank_worst(k, support)["peak"]
        for plan in depth_plans(cfg, layout.microbatches, 6):
            assert mm.rank_peak(k, plan)["peak"] <= worst + 1e-6


def test_stage_split_is_the_models() -> None:
    """The planner's stage work comes from LoopedGPT.recurrence_slice's split, with the same
    padded vocabulary and TBPTT window as the model's forward."""
    from types import SimpleNamespace

    from megaloop.model.looped import LoopedGPT
    from megaloop.model.pipeline_split import split_costs

    for overrides in ([], ["model.n_prelude=2", "model.n_coda=0"], ["model.n_core=3"], ["model.recompute=true"]):
        cfg = load_config("tiny", overrides).model
        padded = cfg.padded_vocab(V)
        for stages in (1, 2, 4, 8):
            for depth in (1, 2, 5, 13, 64):
                work = stage_work(cfg, depth, stages, padded)
                window = min(depth, cfg.bptt_window)
                for v in range(stages):
                    ns = SimpleNamespace(cfg=cfg, num_stages=stages, stage=v, split_costs=split_costs(cfg, padded))
                    lo, hi = LoopedGPT.recurrence_slice(ns, depth, window)
                    assert work[v].recurrences == hi - lo
                    assert work[v].grad_recurrences == len(set(range(lo, hi)) & set(range(depth - window, depth)))


@pytest.mark.parametrize("qk_norm,groups", [(False, 2), (True, 2), (True, 4)])
def test_layer_formula_counts_what_autograd_saves(megatron_world, one_thread, qk_norm, groups) -> None:
    """fp32 local spec: the bytes one layer's forward saves for backward (unique storages, weights
    excluded) equal the planner's per-visit formula (GQA, SwiGLU width not a multiple of d), with
    and without QK-norm (and QK-norm with MHA)."""
    import torch
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megaloop.model.config import ModelConfig
    from megaloop.model.looped import LayerStack
    from megaloop.model.specs import layer_spec, transformer_config

    d, s, b, f, heads = 128, 64, 2, 320, 4
    cfg = ModelConfig(hidden_size=d, num_heads=heads, num_query_groups=groups, ffn_hidden_size=f, seq_len=s,
                      qk_norm=qk_norm)
    tc = transformer_config(cfg, tp=1, pp=1, vpp=None, sequence_parallel=False)
    layer = LayerStack(tc, layer_spec(cfg), [1], None, 0, "probe")
    weights = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    rope = RotaryEmbedding(kv_channels=d // heads, rotary_percent=1.0, rotary_base=10000,
                           use_cpu_initialization=True)(s)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
    seen: dict = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in weights:
            seen[(st.data_ptr(), st.nbytes())] = st.nbytes()
        return t

    x = torch.randn(s, b, d, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, rope, mask)
    plan_cfg = load_config("tiny", [f"model.hidden_size={d}", f"model.num_heads={heads}",
                                    f"model.num_query_groups={groups}", f"model.ffn_hidden_size={f}",
                                    f"model.seq_len={s}", f"train.micro_batch_size={b}", "train.global_batch_size=2",
                                    f"model.qk_norm={str(qk_norm).lower()}"])
    mm = MemoryModel(plan_cfg, make_layout(plan_cfg, 1), CPU, V)
    rope_bytes = 4 * s * (d // heads) * 4
    assert sum(seen.values()) == s * b * mm.layer_bytes() + rope_bytes
