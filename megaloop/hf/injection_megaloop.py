"""Input injections of the looped core (``trust_remote_code``: torch + transformers only).

``h ← exit(core(inject(h, e)))``: ``prepare(e)`` once per forward, ``forward(h, ctx)`` at every
recurrence, ``exit(z)`` on the core output. See modeling_megaloop.py for the formulas.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .configuration_megaloop import MegaloopConfig


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """RMSNorm over the last dim (torch's fused op where available)."""
    if hasattr(F, "rms_norm"):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()  # pragma: no cover - torch < 2.4
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y * weight if weight is not None else y


def input_norm_weight(config: MegaloopConfig) -> Optional[nn.Parameter]:
    """Gains of the RMSNorm on e that ``input_norm`` adds in front of the injection (else None)."""
    return nn.Parameter(torch.ones(config.hidden_size)) if getattr(config, "input_norm", False) else None


def inverse_softplus(y: float) -> float:
    return y + math.log(-math.expm1(-y))


class HuginnInjection(nn.Module):
    """ζ = W [h; e] + b; core exit: parameter-free RMSNorm in FP32."""

    uses_qkv_injection = False

    def __init__(self, config: MegaloopConfig):
        super().__init__()
        self.adapter = nn.Linear(2 * config.hidden_size, config.hidden_size,
                                 bias=bool(getattr(config, "adapter_bias", True)))
        self.exit_eps = config.exit_norm_eps
        self.exit_norm = bool(getattr(config, "exit_norm", True))  # false: the paper's no-exit-norm diagnostic
        self.eps = config.rms_norm_eps
        self.in_norm_weight = input_norm_weight(config)

    def prepare(self, e):
        return rms_norm(e, self.in_norm_weight, self.eps) if self.in_norm_weight is not None else e

    def forward(self, h, e):
        return self.adapter(torch.cat([h, e], dim=-1))

    def exit(self, h):
        return rms_norm(h.float(), None, self.exit_eps).to(h.dtype) if self.exit_norm else h


class DiagonalInjection(nn.Module):
    """Parcae-style ζ = Λ⊙h + q, Λ = exp(−softplus(Δ_raw)·exp(α_log)), q = softplus(Δ_raw)⊙(W ẽ);
    ``parcae_decay``: ẽ = RMSNorm_g(e); ``orthoinj``: carry projected orthogonally to q (FP32);
    ``orthoinj_early``: Δ₀ = 1, carry projected orthogonally to the raw input e."""

    uses_qkv_injection = False

    def __init__(self, config: MegaloopConfig):
        super().__init__()
        d = config.hidden_size
        self.variant = config.injection
        self.eps = config.rms_norm_eps
        self.ortho_eps = config.ortho_eps
        self.delta_raw = nn.Parameter(torch.zeros(d))
        self.alpha_log = nn.Parameter(torch.zeros(d))
        self.proj = nn.Parameter(torch.eye(d))
        self.norm_weight = nn.Parameter(torch.ones(d)) if self.variant == "parcae_decay" else None
        self.in_norm_weight = input_norm_weight(config)  # model.input_norm (not with parcae_decay)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        delta0 = 0.5 * math.log(5.0) if self.variant in ("parcae_decay", "orthoinj") else 1.0
        nn.init.constant_(self.delta_raw, inverse_softplus(delta0))
        nn.init.zeros_(self.alpha_log)
        nn.init.eye_(self.proj)
        for w in (self.norm_weight, self.in_norm_weight):
            if w is not None:
                nn.init.ones_(w)

    def prepare(self, e):
        weight = self.norm_weight if self.norm_weight is not None else self.in_norm_weight
        e_t = rms_norm(e, weight, self.eps) if weight is not None else e
        delta = F.softplus(self.delta_raw.float())
        q = (delta * F.linear(e_t.float(), self.proj.float())).to(e.dtype)
        lam = torch.exp(-delta * torch.exp(self.alpha_log.float())).to(e.dtype)
        return (q, lam, e_t) if self.variant == "orthoinj_early" else (q, lam)

    def forward(self, h, ctx):
        q, lam = ctx[0], ctx[1]
        carry = lam * h
        if self.variant in ("orthoinj", "orthoinj_early"):
            anchor = q if self.variant == "orthoinj" else ctx[2]
            qf, vf = anchor.float(), carry.float()
            coef = (qf * vf).sum(-1, keepdim=True) / ((qf * qf).sum(-1, keepdim=True) + self.ortho_eps)
            carry = (vf - coef * qf).to(carry.dtype)
        return carry + q

    def exit(self, h):
        return h


class DEQInjection(nn.Module):
    """No entrance injection (ζ = h); e enters Q/K/V of every core layer."""

    uses_qkv_injection = True

    def prepare(self, e):
        return e

    def forward(self, h, ctx):
        return h

    def exit(self, h):
        return h


def build_injection(config: MegaloopConfig) -> nn.Module:
    if config.injection == "huginn_linear":
        return HuginnInjection(config)
    if config.injection in ("parcae_decay", "parcae_nonorm", "orthoinj", "orthoinj_early"):
        return DiagonalInjection(config)
    return DEQInjection()


__all__ = ["DEQInjection", "DiagonalInjection", "HuginnInjection", "build_injection", "inverse_softplus",
           "rms_norm"]
