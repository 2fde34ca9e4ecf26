"""Building blocks of the exported looped model (``trust_remote_code``: torch + transformers only):
RMSNorm, SwiGLU MLP, grouped-query attention with rotary embeddings (optionally QK-norm and DEQ-QKV
injection of ``e``), the scaled token embedding and the pre-norm layer. The model and its
recurrence are in ``modeling_megaloop.py``."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .configuration_megaloop import MegaloopConfig
from .injection_megaloop import rms_norm


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, base: float, dtype: torch.dtype):
    """cos/sin tables [b, 1, s, head_dim] for integer ``positions`` [b, s] (non-interleaved)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                            device=positions.device) / head_dim))
    freqs = positions.to(torch.float32)[..., None] * inv_freq  # [b, s, hd/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [b, 1, s, hd]
    return torch.cos(emb).to(dtype), torch.sin(emb).to(dtype)


def apply_rotary(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding of t [b, heads, s, hd]."""
    t1, t2 = torch.chunk(t, 2, dim=-1)
    return t * cos + torch.cat((-t2, t1), dim=-1) * sin


# ----------------------------------------------------------------------------- modules
class MegaloopRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class MegaloopMLP(nn.Module):
    def __init__(self, config: MegaloopConfig):
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MegaloopAttention(nn.Module):
    """Causal GQA self-attention over [cached prefix banks; new tokens]. With ``inject`` (DEQ-QKV
    core layers) ``q/k/v_inject(e)`` is added to the projections."""

    def __init__(self, config: MegaloopConfig, inject: bool = False):
        super().__init__()
        d, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.q_proj = nn.Linear(d, self.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, d, bias=False)
        self.qk_norm = bool(getattr(config, "qk_norm", False))
        if self.qk_norm:
            self.q_norm = MegaloopRMSNorm(hd, config.rms_norm_eps)
            self.k_norm = MegaloopRMSNorm(hd, config.rms_norm_eps)
            if not getattr(config, "qk_norm_gain", True):  # weightless QK-norm: the gains stay at 1, untrained
                self.q_norm.weight.requires_grad_(False)
                self.k_norm.weight.requires_grad_(False)
        self.qk_bias = bool(getattr(config, "qk_bias", False))
        if self.qk_bias:  # Huginn's per-head query/key biases, added before RoPE
            self.q_bias = nn.Parameter(torch.zeros(self.num_heads, hd))
            self.k_bias = nn.Parameter(torch.zeros(self.num_kv_heads, hd))
        self.inject = inject
        if inject:
            self.q_inject = nn.Linear(d, self.num_heads * hd, bias=False)
            self.k_inject = nn.Linear(d, self.num_kv_heads * hd, bias=False)
            self.v_inject = nn.Linear(d, self.num_kv_heads * hd, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: Optional[torch.Tensor],
                past: Optional[tuple[torch.Tensor, torch.Tensor]], e: Optional[torch.Tensor] = None):
        b, s, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.inject:
            q, k, v = q + self.q_inject(e), k + self.k_inject(e), v + self.v_inject(e)
        q = q.view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.qk_bias:  # [heads, hd] -> [heads, 1, hd] over [b, heads, s, hd]
            q, k = q + self.q_bias[:, None].to(q.dtype), k + self.k_bias[:, None].to(k.dtype)
        cos, sin = rope
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        new_kv = (k, v)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        if self.num_kv_heads != self.num_heads:
            rep = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and s > 1,
                                             scale=1.0 / math.sqrt(self.head_dim))
        out = out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim)
        return self.o_proj(out), new_kv


class MegaloopEmbedding(nn.Embedding):
    """Token embedding whose output is multiplied by ``config.embedding_multiplier`` (1 = plain);
    a tied head uses the unscaled weight. The factor is ``embed_scale``, the name PEFT looks for (as
    on Gemma's scaled embedding) to scale a LoRA adapter's output alike, so a merged adapter equals
    the trained one."""

    def __init__(self, config: MegaloopConfig):
        super().__init__(config.vocab_size, config.hidden_size)
        self.embed_scale = float(getattr(config, "embedding_multiplier", 1.0))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super().forward(input_ids)
        return x * self.embed_scale if self.embed_scale != 1.0 else x


class MegaloopLayer(nn.Module):
    """Pre-norm transformer layer; returns (output, this layer's new (k, v)). With
    ``config.sandwich_norm`` (Huginn's sandwich block) the residual stream is renormalised after
    each residual add by ``post_attn_norm`` / ``post_mlp_norm``."""

    def __init__(self, config: MegaloopConfig, inject: bool = False):
        super().__init__()
        self.input_layernorm = MegaloopRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MegaloopAttention(config, inject=inject)
        self.post_attention_layernorm = MegaloopRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MegaloopMLP(config)
        self.sandwich = bool(getattr(config, "sandwich_norm", False))
        if self.sandwich:
            self.post_attn_norm = MegaloopRMSNorm(config.hidden_size, config.rms_norm_eps)
            self.post_mlp_norm = MegaloopRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, rope, mask, past, e=None):
        a, kv = self.self_attn(self.input_layernorm(x), rope, mask, past, e)
        x = x + a
        if self.sandwich:
            x = self.post_attn_norm(x)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return (self.post_mlp_norm(x) if self.sandwich else x), kv


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, num_items: Optional[object] = None) -> torch.Tensor:
    """CE of ``logits`` [b, s, V] against ``labels`` [b, s] shifted by one (-100 ignored): the mean, or
    with ``num_items`` (HF Trainer's ``num_items_in_batch`` under gradient accumulation, which it then
    no longer divides by the accumulation steps itself) the sum over that count."""
    flat = logits[:, :-1].float().reshape(-1, logits.shape[-1])
    loss = F.cross_entropy(flat, labels[:, 1:].reshape(-1).to(logits.device), ignore_index=-100,
                           reduction="mean" if num_items is None else "sum")
    return loss if num_items is None else loss / torch.as_tensor(num_items, device=loss.device)


class VocabResizeMixin:
    """``resize_token_embeddings(n)`` (tokens added in fine-tuning) also sets
    ``config.tokenizer_vocab_size`` (the ids that are not padding) to ``n``: it stayed at the old
    size, so generation and megaloop treated the new tokens as padding and never emitted them."""

    def resize_token_embeddings(self, new_num_tokens: Optional[int] = None, *args, **kwargs):
        old_real = int(self.config.tokenizer_vocab_size)
        out = super().resize_token_embeddings(new_num_tokens, *args, **kwargs)
        if new_num_tokens is not None:
            self.config.tokenizer_vocab_size = min(int(new_num_tokens), int(self.config.vocab_size))
            unpad_generation(self, old_real)
        return out


def unpad_generation(model, old_real: int) -> None:
    """``generation_config.suppress_tokens`` after ``config.tokenizer_vocab_size`` changed from
    ``old_real``: the padding ids (from the new size to ``vocab_size``) and the user's own ids below
    the old padding; the export suppresses the padding ids, so added tokens were still never generated."""
    gc = getattr(model, "generation_config", None)
    real, rows = int(model.config.tokenizer_vocab_size), int(model.config.vocab_size)
    if gc is None or (gc.suppress_tokens is None and real >= rows):
        return
    gc.suppress_tokens = sorted({int(i) for i in gc.suppress_tokens or () if int(i) < min(old_real, real)}
                                | set(range(real, rows))) or None
