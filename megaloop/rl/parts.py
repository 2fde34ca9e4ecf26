"""A looped LM cut into the pieces the gradient estimators of :mod:`megaloop.rl.reuse` need.

``LoopedParts`` (a structural protocol) is the whole interface::

    e   = parts.prelude(inputs)     # embedding + prelude; keeps its graph to the prelude params
    z⁰  = parts.init_state(e)       # recurrent state init h⁰
    z'  = parts.step(z, e)          # ONE recurrence F_θ(z; e) = exit(core(inject(z, e)))
    out = parts.readout(z)          # coda + final norm + head -> logits [batch, seq, vocab]
    parts.parameters()              # the trainable parameters (gradients accumulate into .grad)

A state ``z`` is whatever the model carries between recurrences (the whole sequence's state:
through attention, token ``t``'s next state depends on the states of tokens ``≤ t``). The
estimators only ever call these five methods, so any model — the HF export
(:class:`HFLoopedParts`), the native megatron ``LoopedGPT`` (:class:`NativeLoopedParts`) or a toy
map in a test — plugs in.

Adapters run the plain parallel (training-style, no KV cache) pass: each token's recurrence
``r`` attends causally to the other tokens' recurrence-``r`` states, exactly as the model's own
``forward(use_cache=False)``. ``init_state`` follows the model's mode (eval mode: the
deterministic per-position Gaussian or zeros; train mode: fresh noise), so RL keeps models in
eval mode (there is no dropout) to score rollouts with the state init they were sampled with.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class LoopedParts(Protocol):
    def parameters(self) -> list[nn.Parameter]: ...

    def prelude(self, inputs: Any) -> torch.Tensor: ...

    def init_state(self, e: torch.Tensor) -> torch.Tensor: ...

    def step(self, z: torch.Tensor, e: torch.Tensor) -> torch.Tensor: ...

    def readout(self, z: torch.Tensor) -> torch.Tensor: ...


class _ContextMemo:
    """Caches ``injection.prepare(e)`` for the current ``e`` (one entry), built with autograd
    enabled whenever ``e`` carries a graph — a first ``step`` under ``no_grad`` (the skipped
    recurrences of TBPTT or recompute) must not leave a graph-less context for later steps."""

    def __init__(self) -> None:
        self.e: torch.Tensor | None = None
        self.ctx: Any = None

    def get(self, e: torch.Tensor, prepare) -> Any:
        if self.e is not e:
            with torch.enable_grad() if e.requires_grad else nullcontext():
                self.ctx = prepare(e)
            self.e = e
        return self.ctx

    def clear(self) -> None:
        self.e = self.ctx = None


class HFLoopedParts:
    """:class:`LoopedParts` over :class:`megaloop.hf.modeling_megaloop.MegaloopForCausalLM`.

    ``inputs`` are token ids [b, s] at positions ``0..s-1`` (no padding on the left; padding on
    the right is harmless under causal attention). States are [b, s, d]. Numerically identical to
    ``model(ids, use_cache=False, num_recurrences=R)`` when the recurrences are chained.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.body = model.model
        self.config = model.config
        if not self.config.looped:
            raise ValueError("HFLoopedParts needs a looped model (arch='looped'), got an untied one")
        self._rope_key: tuple | None = None
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self._positions: torch.Tensor | None = None
        self._ctx = _ContextMemo()

    def parameters(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def rope(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary tables for a [b, s, d] tensor at positions 0..s-1 (memoised per shape)."""
        from megaloop.hf.modeling_megaloop import rotary_cos_sin

        b, s = x.shape[0], x.shape[1]
        key = (b, s, x.dtype, x.device)
        if key != self._rope_key:
            self._positions = torch.arange(s, device=x.device)[None].expand(b, s)
            self._rope = rotary_cos_sin(self._positions, self.config.head_dim, self.config.rope_theta, x.dtype)
            self._rope_key = key
        assert self._rope is not None
        return self._rope

    def positions(self, x: torch.Tensor) -> torch.Tensor:
        self.rope(x)
        assert self._positions is not None
        return self._positions

    def prelude(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.body.embed_tokens(ids)
        rope = self.rope(x)
        for layer in self.body.prelude:
            x, _ = layer(x, rope, None, None)
        self._ctx.clear()
        return x

    def init_state(self, e: torch.Tensor) -> torch.Tensor:
        return self.body.init_state(e, self.positions(e))

    def step(self, z: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        inj = self.body.injection
        ctx = self._ctx.get(e, inj.prepare)
        rope = self.rope(z)
        e_qkv = e if inj.uses_qkv_injection else None
        z = inj(z, ctx)
        for layer in self.body.core:
            z, _ = layer(z, rope, None, None, e_qkv)
        return inj.exit(z)

    def readout(self, z: torch.Tensor) -> torch.Tensor:
        rope = self.rope(z)
        for layer in self.body.coda:
            z, _ = layer(z, rope, None, None)
        return self.model.lm_head(self.body.norm(z))


class NativeLoopedParts:
    """:class:`LoopedParts` over the native megatron :class:`megaloop.model.looped.LoopedGPT`
    (one pipeline stage holding prelude, core and coda; any TP=1 build). States are
    sequence-first [s, b, d] as in the native model; ``readout`` returns logits [b, s, V]."""

    def __init__(self, model: nn.Module, noise_seed: int | list[int] | None = 0):
        self.model = model
        self.cfg = model.cfg
        if not self.cfg.looped:
            raise ValueError("NativeLoopedParts needs a looped model")
        if not (model.pre_process and model.post_process):
            raise ValueError("NativeLoopedParts needs a single-stage model (pipeline size 1)")
        self.noise_seed = noise_seed
        self._ctx = _ContextMemo()
        self._rope: dict[int, torch.Tensor] = {}

    def parameters(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def rope(self, s: int) -> torch.Tensor:
        if s not in self._rope:
            self._rope[s] = self.model.rope(s)
        return self._rope[s]

    def prelude(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed(ids)  # [s, b, d], embedding scale included
        self._ctx.clear()
        return self.model.prelude(x, self.rope(x.shape[0])) if self.cfg.n_prelude else x

    def init_state(self, e: torch.Tensor) -> torch.Tensor:
        return self.model.init_state(e, self.noise_seed)

    def step(self, z: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        ctx = self._ctx.get(e, self.model.injection.prepare)
        return self.model.recur(z, e, ctx, self.rope(z.shape[0]))

    def readout(self, z: torch.Tensor) -> torch.Tensor:
        m = self.model
        h = m.coda(z, self.rope(z.shape[0])) if self.cfg.n_coda else z
        h = m.final_norm(h)
        weight = m.shared_embedding_or_output_weight() if m.share_embeddings_and_output_weights else None
        logits, _ = m.output_layer(h, weight=weight)
        return logits.transpose(0, 1)


def looped_parts(model: nn.Module, **kwargs) -> LoopedParts:
    """The adapter for ``model`` (HF ``MegaloopForCausalLM`` or native ``LoopedGPT``); a model
    that already implements :class:`LoopedParts` is returned as is."""
    if isinstance(model, LoopedParts):
        return model
    if hasattr(model, "model") and hasattr(model, "lm_head") and hasattr(model.model, "injection"):
        return HFLoopedParts(model)
    if hasattr(model, "recur") and hasattr(model, "cfg"):
        return NativeLoopedParts(model, **kwargs)
    raise TypeError(f"no LoopedParts adapter for {type(model).__name__}")
