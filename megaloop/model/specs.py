"""Layer specs and the megatron ``TransformerConfig`` for megaloop models.

``local`` spec (megatron-core modules, any device) or Transformer Engine spec (GPU, FP8 via TE's
recipe). Both use pre-norm RMSNorm, SwiGLU MLPs, rotary attention and no biases. Checkpoint keys
are the same for both (the local spec maps its norms onto TE's fused-norm names).
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
import importlib.util
import math
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer

from megaloop.config_utils import ConfigError
from megaloop.model.config import ModelConfig


class RMSNorm(MegatronModule):
    """RMSNorm over the last dim, [..., h] -> [..., h], with learned gains.

    Unlike megatron's torch-norm wrapper it supports sequence parallelism: its weight is tagged
    ``sequence_parallel`` so megatron all-reduces its gradient over the TP group.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: Any):
        super().__init__(config=config)
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class FixedGainRMSNorm(RMSNorm):
    """:class:`RMSNorm` whose gains stay at 1 (``requires_grad=False``): a weightless RMSNorm that
    keeps the learned-gain module's state-dict layout (``model.qk_norm_gain=false``)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **kw: Any):
        super().__init__(config, hidden_size, eps, **kw)
        self.weight.requires_grad_(False)
        self.weight.sequence_parallel = False  # no gradient to reduce


def _normed_bda(bda: Any, norm: torch.nn.Module) -> Any:
    """megatron's bias-dropout-add factory ``bda(training, fused)(out_with_bias, residual, p)``
    followed by ``norm`` on its result (the residual sum)."""
    def factory(training: bool, fused: bool) -> Any:
        add = bda(training, fused)
        return lambda out_with_bias, residual, prob: norm(add(out_with_bias, residual, prob))
    return factory


class SandwichTransformerLayer(TransformerLayer):
    """Huginn's sandwich block on megatron's layer: [s, b, h] -> [s, b, h] with
    ``x <- post_attn_norm(x + attn(input_layernorm(x)))``, ``x <- post_mlp_norm(x + mlp(pre_mlp_layernorm(x)))``.

    The two learned-gain RMSNorms wrap megatron's bias-dropout-add, so everything else (TP, SP,
    recompute, the TE spec) is megatron's layer unchanged.
    """

    def __init__(self, config: TransformerConfig, submodules: Any, *args: Any, **kwargs: Any):
        super().__init__(config, submodules, *args, **kwargs)
        self.post_attn_norm = RMSNorm(config, config.hidden_size, eps=config.layernorm_epsilon)
        self.post_mlp_norm = RMSNorm(config, config.hidden_size, eps=config.layernorm_epsilon)
        self.self_attn_bda = _normed_bda(self.self_attn_bda, self.post_attn_norm)
        self.mlp_bda = _normed_bda(self.mlp_bda, self.post_mlp_norm)


def rms_norm_noparam(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Parameter-free RMSNorm (Huginn-Linear core-exit norm), computed in FP32."""
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


class DEQInjectedSelfAttention(SelfAttention):
    """Self-attention whose Q/K/V receive ``W^e e`` (DEQ-QKV injection, SPEC §2).

    ``linear_qkv_inject`` is a bias-free column-parallel projection with the same output layout
    as ``linear_qkv``, so adding its output to the fused QKV activations adds ``W_Q^e e``,
    ``W_K^e e`` and ``W_V^e e`` head by head on every TP rank. The injected input is set per
    forward with :meth:`set_injection` (None disables it).
    """

    def __init__(self, config: TransformerConfig, submodules: Any, layer_number: int, **kwargs: Any):
        super().__init__(config, submodules, layer_number, **kwargs)
        std = getattr(config, "deq_std", config.init_method_std)
        self.linear_qkv_inject = tensor_parallel.ColumnParallelLinear(
            config.hidden_size,
            self.linear_qkv_out_dim,
            config=config,
            init_method=lambda w: torch.nn.init.normal_(w, 0.0, std),
            gather_output=False,
            bias=False,
            skip_bias_add=True,
        )
        self._inject_e: torch.Tensor | None = None
        self.linear_qkv.register_forward_hook(self._add_injection)

    def set_injection(self, e: torch.Tensor | None) -> None:
        self._inject_e = e

    def _add_injection(self, _module: Any, _inputs: Any, output: Any) -> Any:
        if self._inject_e is None:
            return output
        out, bias = output
        return out + self.linear_qkv_inject(self._inject_e)[0], bias


class QKBiasMixin:
    """Huginn's per-head query/key biases on a megatron ``SelfAttention``: ``q_bias`` [n/tp, hd] and
    ``k_bias`` [g/tp, hd], zero-initialised, added to every position's query and key heads after
    the projection (and QK-norm) and before RoPE. Split over TP with the heads (axis 0 in the
    distributed checkpoint); no weight decay."""

    def __init__(self, config: TransformerConfig, submodules: Any, layer_number: int, **kwargs: Any):
        super().__init__(config, submodules, layer_number, **kwargs)
        hd, dt = self.hidden_size_per_attention_head, config.params_dtype
        self.q_bias = torch.nn.Parameter(torch.zeros(self.num_attention_heads_per_partition, hd, dtype=dt))
        self.k_bias = torch.nn.Parameter(torch.zeros(self.num_query_groups_per_partition, hd, dtype=dt))
        for p in (self.q_bias, self.k_bias):
            tensor_parallel.set_tensor_model_parallel_attributes(p, is_parallel=True, dim=0, stride=1)
            p.no_weight_decay = True

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True):
        out = super().get_query_key_value_tensors(hidden_states, key_value_states, output_gate=output_gate,
                                                  split_qkv=split_qkv)
        if not split_qkv:  # pragma: no cover - only megatron's fused single-QKV RoPE asks for this
            raise NotImplementedError("model.qk_bias: needs split Q/K/V (fused_single_qkv_rope is off)")
        q, k, *rest = out  # [sq, b, n/tp, hd], [sk, b, g/tp, hd]
        return (q + self.q_bias.to(q.dtype), k + self.k_bias.to(k.dtype), *rest)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        local = {n: getattr(self, n) for n in ("q_bias", "k_bias")}
        sd.update(make_sharded_tensors_for_checkpoint(
            local, prefix, {n: 0 for n in local}, sharded_offsets,
            tp_group=getattr(self, "tp_group", None) or parallel_state.get_tensor_model_parallel_group(),
            dp_cp_group=parallel_state.get_data_parallel_group(with_context_parallel=True)))
        return sd


class QKBiasSelfAttention(QKBiasMixin, SelfAttention):
    """megatron's ``SelfAttention`` with :class:`QKBiasMixin`."""


class QKBiasDEQSelfAttention(QKBiasMixin, DEQInjectedSelfAttention):
    """:class:`DEQInjectedSelfAttention` with :class:`QKBiasMixin`."""


class SDPACoreAttention(DotProductAttention):
    """megatron's local core attention computed by ``F.scaled_dot_product_attention`` (fused
    flash/memory-efficient kernels on CPU and GPU instead of explicit [b, n, s, s] scores).

    query [sq, b, n/tp, hd], key/value [sk, b, g/tp, hd] -> context [sq, b, n·hd/tp]. Causal
    (``attn_mask_type`` causal; megaloop's models only build causal masks, so a given
    ``attention_mask`` is that causal mask and is not re-read). GQA groups are expanded by SDPA.
    """

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None or self.softmax_offset is not None:
            raise NotImplementedError("SDPACoreAttention: packed sequences, attention bias and softmax "
                                      "offsets are not supported (use megatron's DotProductAttention)")
        if attention_mask is not None and attention_mask.shape[-2:] != (query.shape[0], key.shape[0]):
            raise ValueError(f"SDPACoreAttention: mask {tuple(attention_mask.shape)} does not match "
                             f"{query.shape[0]} queries x {key.shape[0]} keys")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hd]
        p = self.attention_dropout.p if self.training else 0.0
        causal = (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
        with tensor_parallel.get_cuda_rng_tracker().fork() if p > 0 else nullcontext():
            ctx = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=causal,
                                                 scale=self.softmax_scale, enable_gqa=k.shape[1] != q.shape[1])
        sq, b = query.shape[0], query.shape[1]
        return ctx.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)


def use_transformer_engine(cfg: ModelConfig) -> bool:
    """Resolve ``transformer_impl``: TE only with CUDA and an importable TE."""
    if cfg.transformer_impl == "local":
        return False
    has_te = torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None
    if has_te:
        try:  # the PyTorch extension, not only the package (binary wheels can raise RuntimeError)
            import transformer_engine.pytorch  # noqa: F401
        except Exception:  # pragma: no cover - GPU only
            has_te = False
    if cfg.transformer_impl == "transformer_engine" and not has_te:
        raise ConfigError("model.transformer_impl: transformer_engine requested but TE/CUDA is unavailable")
    return has_te


def split_qkv_orthogonal(std: float, heads: int, groups: int, head_dim: int):
    """Init of megatron's fused QKV master weight [(heads + 2·groups)·head_dim, d] as three
    orthogonal matrices q [heads·head_dim, d], k, v [groups·head_dim, d] (each at gain
    std·√max(rows, cols)), placed in megatron's per-group layout [groups, (heads/groups)·q | k | v]."""
    def init(w: torch.Tensor) -> torch.Tensor:
        d, per = w.shape[1], heads // groups
        if w.shape[0] != (heads + 2 * groups) * head_dim:
            raise ValueError(f"QKV master weight of {tuple(w.shape)} rows, expected {(heads + 2 * groups) * head_dim}")
        q, k, v = (_orthogonal(std)(w.new_empty(n * head_dim, d)) for n in (heads, groups, groups))
        with torch.no_grad():
            w.copy_(torch.cat([q.view(groups, per * head_dim, d), k.view(groups, head_dim, d),
                               v.view(groups, head_dim, d)], dim=1).reshape_as(w))
        return w
    return init


class SplitInitQKVLinear(tensor_parallel.ColumnParallelLinear):
    """megatron's fused QKV projection (``ColumnParallelLinear``) whose CPU-built master weight is
    initialised by :func:`split_qkv_orthogonal` (``model.qkv_init_split``); each TP rank then keeps
    its slice as usual, so the init is the same under every TP degree."""

    def __init__(self, input_size: int, output_size: int, *, config: TransformerConfig, init_method, **kw):
        init_method = split_qkv_orthogonal(config.init_method_std, config.num_attention_heads,
                                           config.num_query_groups or config.num_attention_heads, config.kv_channels)
        super().__init__(input_size, output_size, config=config, init_method=init_method, **kw)


def layer_spec(cfg: ModelConfig, deq_inject: bool = False) -> ModuleSpec:
    """The transformer-layer spec: TE on GPU when available, megatron-core local otherwise."""
    if use_transformer_engine(cfg):  # pragma: no cover - GPU only
        if cfg.qkv_init_split:
            raise ConfigError("model.qkv_init_split: only with the local spec (model.transformer_impl=local)")
        if not cfg.qk_norm_gain:
            raise ConfigError("model.qk_norm_gain: false only with the local spec (model.transformer_impl=local)")
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = copy.deepcopy(get_gpt_layer_with_transformer_engine_spec(qk_layernorm=cfg.qk_norm))
    else:
        spec = copy.deepcopy(get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=cfg.qk_norm))
        if cfg.local_attention == "sdpa":
            spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
        spec.submodules.input_layernorm = RMSNorm
        spec.submodules.pre_mlp_layernorm = RMSNorm
        if cfg.qkv_init_split:
            spec.submodules.self_attention.submodules.linear_qkv = SplitInitQKVLinear
        if cfg.qk_norm:  # per-head [head_dim] gains, shared by the heads (megatron sums them over TP)
            qk_norm = RMSNorm if cfg.qk_norm_gain else FixedGainRMSNorm
            spec.submodules.self_attention.submodules.q_layernorm = qk_norm
            spec.submodules.self_attention.submodules.k_layernorm = qk_norm
    if deq_inject:
        spec.submodules.self_attention.module = QKBiasDEQSelfAttention if cfg.qk_bias else DEQInjectedSelfAttention
    elif cfg.qk_bias:
        spec.submodules.self_attention.module = QKBiasSelfAttention
    if cfg.sandwich_norm:
        spec.module = SandwichTransformerLayer
    return spec


def _orthogonal(std: float):
    """Orthogonal init whose entries have std ``std`` on average: gain std·√max(rows, cols)."""
    def init(w: torch.Tensor) -> torch.Tensor:
        rows = w.shape[0]
        return torch.nn.init.orthogonal_(w, gain=std * math.sqrt(max(rows, w.numel() // rows)))
    return init


def _init(cfg: ModelConfig):
    """Init of every other weight matrix (embedding, QKV, fc1, untied head): megatron's normal at
    ``init_std`` by default (None)."""
    return _orthogonal(cfg.init_std_value) if cfg.init_orthogonal else None


def _out_init(cfg: ModelConfig):
    """Init of the residual-output projections: megatron's scaled normal by default (None)."""
    if cfg.out_init_std is None:
        if not cfg.init_orthogonal:
            return None
        std = cfg.init_std_value / math.sqrt(2.0 * cfg.physical_layers)  # megatron's scaled std
    else:
        std = float(cfg.out_init_std)
    if std == 0.0:
        return torch.nn.init.zeros_
    if cfg.init_orthogonal:
        return _orthogonal(std)
    return lambda w: torch.nn.init.normal_(w, 0.0, std)


def transformer_config(cfg: ModelConfig, *, tp: int, pp: int, vpp: int | None,
                       sequence_parallel: bool) -> TransformerConfig:
    """megatron ``TransformerConfig`` for ``cfg`` under the given parallel layout."""
    cfg.validate_parallel(tp, sequence_parallel)
    te = use_transformer_engine(cfg)
    if cfg.fp8 and not te:
        raise ConfigError("model.fp8: FP8 needs Transformer Engine on a CUDA device")
    if cfg.fp8 and (cfg.ffn_size // tp) % 16:
        raise ConfigError(f"model.fp8: the SwiGLU width per TP rank ({cfg.ffn_size} / {tp}) must be a multiple of 16")
    dtype = torch.bfloat16 if cfg.bf16 else torch.float32
    tc = TransformerConfig(
        num_layers=max(cfg.physical_layers, pp),
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_heads,
        num_query_groups=cfg.groups,
        ffn_hidden_size=cfg.ffn_size,
        kv_channels=cfg.hidden_size // cfg.num_heads,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=cfg.init_std_value,
        init_method=_init(cfg),
        output_layer_init_method=_out_init(cfg),
        qk_layernorm=cfg.qk_norm,
        use_cpu_initialization=True,
        perform_initialization=True,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if (vpp or 1) > 1 else None,
        sequence_parallel=sequence_parallel and tp > 1,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=cfg.bf16,
        calculate_per_token_loss=True,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=te,
        bias_dropout_fusion=False,
        masked_softmax_fusion=te,
        persist_layer_norm=False,
        cross_entropy_loss_fusion=False,
        deallocate_pipeline_outputs=False,
        fp8=cfg.fp8,
        fp8_recipe=cfg.fp8_recipe if cfg.fp8 else None,
    )
    tc.deq_std = cfg.deq_std  # read by DEQInjectedSelfAttention
    return tc
