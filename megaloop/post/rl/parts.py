"""A looped LM cut into the pieces the gradient estimators of :mod:`megaloop.post.rl.reuse` need.

``LoopedParts`` (a structural protocol) is the whole interface::

    e   = parts.encode(inputs)     # embedding + prelude; keeps its graph to the prelude params
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

    def encode(self, inputs: Any) -> torch.Tensor: ...

    def init_state(self, e: torch.Tensor) -> torch.Tensor: ...

    def step(self, z: torch.Tensor, e: torch.Tensor) -> torch.Tensor: ...

    def readout(self, z: torch.Tensor) -> torch.Tensor: ...


class HFLoopedParts:
    """:class:`LoopedParts` over :class:`megaloop.hf.modeling_megaloop.MegaloopForCausalLM`, on the
    export model's recurrence API (:class:`~megaloop.hf.modeling_megaloop.LoopedPass`).

    ``inputs`` are token ids [b, s] at positions ``0..s-1`` (no padding on the left; padding on
    the right is harmless under causal attention). States are [b, s, d]. Numerically identical to
    ``model(ids, use_cache=False, num_recurrences=R)`` when the recurrences are chained.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.config = model.config
        if not self.config.looped:
            raise ValueError("HFLoopedParts needs a looped model (arch='looped'), got an untied one")
        self._pass = None  # the pass of the latest prelude (its e, rotary tables, injection context)

    def parameters(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def pass_for(self, e: torch.Tensor):
        """The pass whose prelude output is ``e`` (a pass over a given ``e`` when it is another)."""
        if self._pass is None or self._pass.e is not e:
            self._pass = self.model.begin(e=e)
        return self._pass

    def positions(self, x: torch.Tensor) -> torch.Tensor:
        return self.pass_for(x).positions

    def encode(self, ids: torch.Tensor) -> torch.Tensor:
        self._pass = self.model.begin(ids)
        return self._pass.e

    def init_state(self, e: torch.Tensor) -> torch.Tensor:
        return self.pass_for(e).init_state()

    def step(self, z: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return self.pass_for(e).step(z)[0]

    def readout(self, z: torch.Tensor) -> torch.Tensor:
        # the readout reads only the pass's positions (rotary tables, mask), never its e: any pass
        # over z's [b, s] positions serves
        same = self._pass is not None and self._pass.e.shape[:2] == z.shape[:2]
        return (self._pass if same else self.model.begin(e=z)).readout(z)[0]


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
        self._ctx: tuple = (None, None)  # (e, injection context of e)
        self._rope: dict[int, torch.Tensor] = {}

    def parameters(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def rope(self, s: int) -> torch.Tensor:
        if s not in self._rope:
            self._rope[s] = self.model.rope(s)
        return self._rope[s]

    def encode(self, ids: torch.Tensor) -> torch.Tensor:
        self._ctx = (None, None)
        return self.model.encode(ids)

    def init_state(self, e: torch.Tensor) -> torch.Tensor:
        return self.model.init_state(e, self.noise_seed)

    def step(self, z: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        if self._ctx[0] is not e:  # built with autograd when e has a graph (see LoopedPass.ctx)
            with torch.enable_grad() if e.requires_grad else nullcontext():
                self._ctx = (e, self.model.context(e))
        return self.model.recur(z, e, self._ctx[1], self.rope(z.shape[0]))

    def readout(self, z: torch.Tensor) -> torch.Tensor:
        return self.model.readout(z)


def looped_parts(model: nn.Module, **kwargs) -> LoopedParts:
    """The adapter for ``model`` (HF ``MegaloopForCausalLM`` or native ``LoopedGPT``); a model
    that already implements :class:`LoopedParts` is returned as is."""
    if isinstance(model, LoopedParts):
        return model
    if hasattr(model, "begin") and hasattr(model, "lm_head"):
        return HFLoopedParts(model)
    if hasattr(model, "recur") and hasattr(model, "cfg"):
        return NativeLoopedParts(model, **kwargs)
    raise TypeError(f"no LoopedParts adapter for {type(model).__name__}")
