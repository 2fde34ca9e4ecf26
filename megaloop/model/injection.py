"""Input-injection variants ζ = Inject(h, e) (SPEC §2). Tensors are [s, b, d], sequence-first.

Each injection splits its work into :meth:`prepare` (everything that depends only on the
prelude output ``e``, computed once per forward and reused at every recurrence) and
:meth:`forward` (the per-recurrence combination with the state ``h``). Parameters are shared
across recurrences and replicated over TP ranks; under sequence parallelism they are tagged
``sequence_parallel`` so megatron all-reduces their gradients over the TP group.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megaloop.model.specs import rms_norm_noparam


def inverse_softplus(y: float) -> float:
    """x with softplus(x) = y (y > 0)."""
    return y + math.log(-math.expm1(-y))


class Injection(MegatronModule):
    """Base: ``prepare(e) -> ctx``; ``forward(h, ctx) -> ζ``; ``exit(h) -> h`` after the core.

    With ``input_norm`` (model.input_norm) the injection reads ``RMSNorm_g(e)`` (learned gains
    ``in_norm_weight``) instead of the raw prelude output, as Parcae's ``prelude_norm`` does."""

    uses_qkv_injection = False

    def __init__(self, config: TransformerConfig, input_norm: bool = False):
        super().__init__(config=config)
        self.in_norm_weight = (torch.nn.Parameter(torch.ones(config.hidden_size, dtype=config.params_dtype))
                               if input_norm else None)

    def read_input(self, e: torch.Tensor) -> torch.Tensor:
        """e as the injection sees it: RMSNorm_g(e) with ``input_norm``, else e itself."""
        if self.in_norm_weight is None:
            return e
        return F.rms_norm(e, (e.shape[-1],), self.in_norm_weight, self.config.layernorm_epsilon)

    def _tag(self) -> None:
        for p in self.parameters():
            p.sequence_parallel = self.config.sequence_parallel

    def prepare(self, e: torch.Tensor) -> Any:
        return e

    def exit(self, h: torch.Tensor) -> torch.Tensor:
        return h


class HuginnLinear(Injection):
    """ζ = W_in [h; e; 1]; the core output passes a parameter-free RMSNorm (exit norm).

    ``init``: ``torch`` (torch's default Linear init, the recipe's) or ``normal`` (the config's weight
    init and a zero bias, as the HF export's init); ``bias=False`` drops the appended 1 (Huginn's code)."""

    def __init__(self, config: TransformerConfig, exit_norm: bool = True, input_norm: bool = False,
                 init: str = "torch", bias: bool = True):
        super().__init__(config, input_norm)
        d = config.hidden_size
        self.exit_norm = exit_norm
        self.adapter = torch.nn.Linear(2 * d, d, bias=bias, dtype=config.params_dtype)
        if init == "normal":
            with torch.no_grad():
                config.init_method(self.adapter.weight)
                if bias:
                    self.adapter.bias.zero_()
        self._tag()

    def prepare(self, e: torch.Tensor) -> torch.Tensor:
        return self.read_input(e)

    def forward(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return self.adapter(torch.cat([h, e], dim=-1))

    def exit(self, h: torch.Tensor) -> torch.Tensor:
        return rms_norm_noparam(h) if self.exit_norm else h


class ParcaeDiagonal(Injection):
    """Diagonal injection: Λ = exp(−Δ⊙α), Δ = softplus(Δ_raw), α = exp(α_log), q = Δ⊙(W ẽ).

    ``variant``: ``parcae_decay`` (ẽ = RMSNorm_g(e), Δ₀ = ½ log 5 → retention 1/√5),
    ``parcae_nonorm`` (ẽ = e, Δ₀ = 1), ``orthoinj`` (ẽ = e, Δ₀ = ½ log 5, carry-over projected
    orthogonally to q), ``orthoinj_early`` (the paper's earlier OrthoInj of its M LR screen: Δ₀ = 1
    and "the raw input e as its anchor", read here as projecting the carry-over orthogonally to e
    instead of q — the paper gives no equation). W starts at I, α at 1. Δ_raw, α_log and W take no
    weight decay.
    """

    def __init__(self, config: TransformerConfig, variant: str, ortho_eps: float = 1e-6,
                 input_norm: bool = False):
        super().__init__(config, input_norm)
        d = config.hidden_size
        self.variant = variant
        self.ortho_eps = ortho_eps
        delta0 = 0.5 * math.log(5.0) if variant in ("parcae_decay", "orthoinj") else 1.0
        dt = config.params_dtype
        self.delta_raw = torch.nn.Parameter(torch.full((d,), inverse_softplus(delta0), dtype=dt))
        self.alpha_log = torch.nn.Parameter(torch.zeros(d, dtype=dt))
        self.proj = torch.nn.Parameter(torch.eye(d, dtype=dt))
        self.norm_weight = (
            torch.nn.Parameter(torch.ones(d, dtype=dt)) if variant == "parcae_decay" else None
        )
        for p in (self.delta_raw, self.alpha_log, self.proj):
            p.no_weight_decay = True
        self._tag()

    def delta(self) -> torch.Tensor:
        return F.softplus(self.delta_raw.float())

    def retention(self) -> torch.Tensor:
        """Λ ∈ (0, 1)^d, the per-channel carry-over factor."""
        return torch.exp(-self.delta() * torch.exp(self.alpha_log.float()))

    def prepare(self, e: torch.Tensor) -> dict[str, torch.Tensor]:
        e_t = F.rms_norm(e, (e.shape[-1],), self.norm_weight, self.config.layernorm_epsilon) \
            if self.norm_weight is not None else self.read_input(e)
        q = (self.delta() * F.linear(e_t.float(), self.proj.float())).to(e.dtype)
        ctx = {"q": q, "lam": self.retention().to(e.dtype)}
        if self.variant == "orthoinj_early":
            ctx["e"] = e_t
        return ctx

    def forward(self, h: torch.Tensor, ctx: dict[str, torch.Tensor]) -> torch.Tensor:
        q, lam = ctx["q"], ctx["lam"]
        carry = lam * h
        if self.variant == "orthoinj":
            carry = project_out(carry, q, self.ortho_eps)
        elif self.variant == "orthoinj_early":
            carry = project_out(carry, ctx["e"], self.ortho_eps)
        return carry + q


def project_out(v: torch.Tensor, q: torch.Tensor, eps: float) -> torch.Tensor:
    """Q_q v = v − q (qᵀv)/(qᵀq + ε) per token, inner products in FP32. [s,b,d] -> [s,b,d]."""
    qf, vf = q.float(), v.float()
    coef = (qf * vf).sum(-1, keepdim=True) / ((qf * qf).sum(-1, keepdim=True) + eps)
    return (vf - coef * qf).to(v.dtype)


class DEQQKV(Injection):
    """No entrance injection (ζ = h); e enters Q/K/V in every core layer (see specs.py)."""

    uses_qkv_injection = True

    def forward(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return h


def build_injection(name: str, config: TransformerConfig, exit_norm: bool = True,
                    input_norm: bool = False, adapter_init: str = "torch", adapter_bias: bool = True) -> Injection:
    if name == "huginn_linear":
        return HuginnLinear(config, exit_norm=exit_norm, input_norm=input_norm, init=adapter_init, bias=adapter_bias)
    if name in ("parcae_decay", "parcae_nonorm", "orthoinj", "orthoinj_early"):
        return ParcaeDiagonal(config, name, input_norm=input_norm)
    if name == "deq_qkv":
        return DEQQKV(config)
    raise ValueError(f"model.injection: unknown injection {name!r}")
