"""The recurrence API of the exported looped model (``trust_remote_code``: torch + stdlib only).

:class:`LoopedPass` walks a ``MegaloopModel`` one piece at a time (prelude, one recurrence, readout);
the model's forward, adaptive decoding and megaloop's own tools (fixed-point solver, RL gradient
estimators, distilled prefill, state diagnostics) all use it, so the recurrence is written once.
Rotary tables live here too (the pass builds them; attention applies them).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, Optional

import torch
from torch import nn

KV = tuple[torch.Tensor, torch.Tensor]
BankReader = Callable[[str, int, int], Optional[KV]]  # (group, layer index, recurrence) -> cached (k, v)


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


# ----------------------------------------------------------------------------- recurrence API
def _take_rows(t, idx: torch.Tensor, b: int):
    """Rows ``idx`` of batch-first tensors (tuples recursed; broadcast tensors kept)."""
    if t is None:
        return None
    if isinstance(t, tuple):
        return tuple(_take_rows(x, idx, b) for x in t)
    return t.index_select(0, idx) if t.dim() >= 2 and t.shape[0] == b else t


class LoopedPass:
    """The recurrence of a looped :class:`MegaloopModel`, one piece at a time — the single way
    code outside this file walks the model (HF forward, adaptive decoding, fixed-point solver,
    RL gradient estimators, distilled prefill)::

        p = lm.begin(input_ids)          # embedding + prelude over the new tokens: p.e [b, s, d]
        h = p.init_state()               # h⁰ [b, s, d] (eval: per-position Gaussian; train: noise)
        h, kv = p.step(h, r)             # recurrence r: exit(core(inject(h, e))); kv: one (k, v) per core layer
        logits, kv = p.readout(h)        # coda → final norm → head: [b, s, V]; kv: one per coda layer

    Attention reads earlier tokens through ``read(group, layer, recurrence)`` (a
    :class:`MegaloopCache`, a dict of frozen banks ``{(group, layer): (k, v)}`` or nothing); the
    new tokens attend to each other causally at the same recurrence, as in training. The new
    K/V are returned, never stored: the caller decides what a cache keeps.
    """

    def __init__(self, model: nn.Module, x: torch.Tensor, positions: torch.Tensor,
                 mask: Optional[torch.Tensor], read: Optional[BankReader], head: Optional[nn.Module] = None,
                 e: Optional[torch.Tensor] = None):
        cfg = model.config
        self.model, self.config, self.head = model, cfg, head
        self.positions, self.mask = positions, mask
        self.read: BankReader = read or (lambda group, index, recurrence: None)
        self.rope = rotary_cos_sin(positions, cfg.head_dim, cfg.rope_theta, x.dtype)
        self.prelude_kv: list[KV] = []
        if e is None:
            for i, layer in enumerate(model.prelude):
                x, kv = layer(x, self.rope, mask, self.read("prelude", i, 0))
                self.prelude_kv.append(kv)
            e = x
        self.e = e
        self.e_qkv = e if model.injection.uses_qkv_injection else None
        self._ctx = None

    @property
    def batch_size(self) -> int:
        return self.e.shape[0]

    @property
    def ctx(self):
        """``injection.prepare(e)``, built once, with autograd whenever ``e`` carries a graph (a
        first step under ``no_grad`` — TBPTT's skipped recurrences — must not leave it graph-less)."""
        if self._ctx is None:
            with torch.enable_grad() if self.e.requires_grad else nullcontext():
                self._ctx = self.model.injection.prepare(self.e)
        return self._ctx

    def init_state(self, zero: bool = False) -> torch.Tensor:
        """``h⁰`` [b, s, d] in the model's mode (``zero=True``: zeros)."""
        return torch.zeros_like(self.e) if zero else self.model.init_state(self.e, self.positions)

    def inject(self, h: torch.Tensor) -> torch.Tensor:
        """The core's input ``inject(h, e)`` [b, s, d] (DEQ-QKV: ``h``; ``e`` enters Q/K/V)."""
        return self.model.injection(h, self.ctx)

    def step(self, h: torch.Tensor, r: int = 0, block=None) -> tuple[torch.Tensor, list[KV]]:
        """Recurrence ``r`` (0-based; selects the per-visit cached banks): ``exit(core(inject(h, e)))``.
        ``block`` (an object with ``injection`` and ``layers``, e.g. a prefill student) replaces the
        model's own injection and core layers."""
        inj, layers = (self.model.injection, self.model.core) if block is None else (block.injection, block.layers)
        ctx = self.ctx if block is None else inj.prepare(self.e)
        z, kvs = inj(h, ctx), []
        for i, layer in enumerate(layers):
            z, kv = layer(z, self.rope, self.mask, self.read("core", i, r), self.e_qkv)
            kvs.append(kv)
        return inj.exit(z), kvs

    def coda(self, h: torch.Tensor) -> tuple[torch.Tensor, list[KV]]:
        """Coda layers over the state (before the final norm) and their K/V."""
        kvs = []
        for i, layer in enumerate(self.model.coda):
            h, kv = layer(h, self.rope, self.mask, self.read("coda", i, 0))
            kvs.append(kv)
        return h, kvs

    def readout(self, h: torch.Tensor, keep: int = 0) -> tuple[torch.Tensor, list[KV]]:
        """Logits [b, s | keep, V] of state ``h`` (coda → final norm → head) and the coda K/V."""
        if self.head is None:
            raise ValueError("readout needs the head: begin the pass on MegaloopForCausalLM")
        x, kvs = self.coda(h)
        x = self.model.norm(x)
        return self.head(x[:, -keep:] if keep else x), kvs

    def rows(self, idx: torch.Tensor) -> "LoopedPass":
        """This pass restricted to batch rows ``idx`` (cached banks gathered on first read)."""
        b, sub = self.batch_size, object.__new__(LoopedPass)
        sub.__dict__.update(self.__dict__)
        sub.positions, sub.mask = _take_rows(self.positions, idx, b), _take_rows(self.mask, idx, b)
        sub.rope, sub.e, sub.e_qkv = _take_rows(self.rope, idx, b), self.e[idx], _take_rows(self.e_qkv, idx, b)
        sub._ctx = _take_rows(self.ctx, idx, b)
        sub.prelude_kv = [_take_rows(kv, idx, b) for kv in self.prelude_kv]
        gathered: dict = {}
        base = self.read

        def read(group: str, index: int, recurrence: int) -> Optional[KV]:
            kv = base(group, index, recurrence)
            if kv is None:
                return None
            key = (group, index, kv[0].data_ptr(), tuple(kv[0].shape))
            if key not in gathered:
                gathered[key] = _take_rows(kv, idx, b)
            return gathered[key]

        sub.read = read
        return sub
