"""KV-cache layer for inference: modes, memory accounting, cache copies (SPEC §7).

A thin, documented layer over :class:`megaloop.hf.modeling_megaloop.MegaloopCache`; the model's
forward fills the cache in place, this module only creates, copies and measures caches.

Modes (banks are per token and per *physical* attention layer; a bank holds one K and one V row
of ``kv_heads × head_dim`` values):

* ``terminal`` — ``n_prelude + n_core + n_coda`` banks: the prelude/coda KV and, for each core
  layer, the KV of the token's terminal (last) recurrence. Every recurrence of a later token reads
  these banks. Memory does not grow with depth.
* ``per_visit`` — ``n_prelude + n_core·R + n_coda`` banks: core layer ℓ keeps one bank per
  recurrence ``r`` (read by recurrence ``r`` of later tokens). Token-by-token decoding in this
  mode equals the plain parallel forward; it is the "full KV" comparison mode.

At the paper's training depth R=5 with 1/2/1 prelude/core/coda layers terminal sharing keeps
4 of 12 banks: ``terminal_over_per_visit(5, 1, 2, 1) == Fraction(4, 12)``.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any, Optional

import torch

from megaloop.config_utils import ConfigError

MODES = ("terminal", "per_visit")


def check_mode(mode: str, field: str = "cache") -> str:
    """Return ``mode`` or raise ConfigError naming ``field``."""
    if mode not in MODES:
        raise ConfigError(f"{field}: unknown KV-cache mode {mode!r}; one of {MODES}")
    return mode


def check_depth(depth: Any, field: str = "depth") -> int:
    """A recurrence budget (int >= 1) or ConfigError naming ``field``."""
    try:
        value = int(depth)
    except (TypeError, ValueError):
        raise ConfigError(f"{field}: recurrence depth must be an integer >= 1, got {depth!r}") from None
    if value != depth or value < 1:
        raise ConfigError(f"{field}: recurrence depth must be an integer >= 1, got {depth!r}")
    return value


# ----------------------------------------------------------------------------- accounting
def banks_per_token(mode: str, R: int, n_prelude: int, n_core: int, n_coda: int) -> int:
    """KV banks one token holds: terminal ``n_prelude + n_core + n_coda``; per-visit
    ``n_prelude + n_core·R + n_coda`` (R = depth of the cached tokens)."""
    check_mode(mode)
    R = check_depth(R, "R")
    return n_prelude + n_coda + n_core * (R if mode == "per_visit" else 1)


def terminal_over_per_visit(R: int, n_prelude: int, n_core: int, n_coda: int) -> Fraction:
    """Exact memory ratio terminal / per-visit at depth R (a :class:`fractions.Fraction`;
    ``Fraction(4, 12)`` — i.e. 1/3 — for R=5 and 1/2/1 layers)."""
    return Fraction(banks_per_token("terminal", R, n_prelude, n_core, n_coda),
                    banks_per_token("per_visit", R, n_prelude, n_core, n_coda))


def _layers(config) -> tuple[int, int, int]:
    if getattr(config, "looped", True) and getattr(config, "arch", "looped") == "looped":
        return config.n_prelude, config.n_core, config.n_coda
    return config.num_hidden_layers, 0, 0  # untied: every layer is a plain (prelude-like) bank


def held_depth(prefill_depth: int, decode_depth: int, policy=None) -> int:
    """The deepest pass a per-visit cache holds a bank of: the prefill's or the decode's, whose cap
    is an exit policy's ``max_depth`` when one decides the depth."""
    return max(int(prefill_depth), int(policy.max_depth if policy is not None else decode_depth))


def kv_bytes_per_token(config, mode: str, R: int, dtype: torch.dtype = torch.float32) -> int:
    """Predicted KV bytes per cached token of one sequence for an HF ``MegaloopConfig``:
    banks × 2 (K and V) × kv_heads × head_dim × element size."""
    n_pre, n_core, n_coda = _layers(config)
    banks = banks_per_token(mode, R, n_pre, n_core, n_coda) if n_core else n_pre
    elsize = torch.empty((), dtype=dtype).element_size()
    return banks * 2 * config.num_key_value_heads * config.head_dim * elsize


@dataclass
class MemoryReport:
    """KV memory of one configuration (per token of one sequence and for a whole batch)."""

    mode: str
    depth: int
    banks_per_token: int
    bytes_per_token: int
    tokens: int
    batch_size: int
    total_bytes: int
    terminal_over_per_visit: Optional[str]  # exact fraction as text, e.g. "1/3"

    def to_dict(self) -> dict:
        return asdict(self)


def memory_report(config, mode: str, R: int, tokens: int = 1, batch_size: int = 1,
                  dtype: torch.dtype = torch.float32) -> MemoryReport:
    """Predicted KV memory of ``batch_size`` sequences of ``tokens`` tokens cached at depth R."""
    n_pre, n_core, n_coda = _layers(config)
    banks = banks_per_token(mode, R, n_pre, n_core, n_coda) if n_core else n_pre
    per = kv_bytes_per_token(config, mode, R, dtype)
    ratio = str(terminal_over_per_visit(R, n_pre, n_core, n_coda)) if n_core else None
    return MemoryReport(mode, int(R), banks, per, int(tokens), int(batch_size), per * tokens * batch_size, ratio)


# ----------------------------------------------------------------------------- caches
def new_cache(model, mode: str):
    """An empty :class:`MegaloopCache` of ``model`` in ``mode`` (ConfigError on a bad mode)."""
    return model.new_cache(check_mode(mode))


@dataclass
class CacheStats:
    """What a filled cache holds (measured from its tensors)."""

    mode: str
    batch_size: int
    tokens: int
    banks: int  # banks per token (incl. every per-visit core bank)
    kv_bytes: int  # all sequences of the batch, valid tokens only
    bytes_per_token: int  # per cached token of one sequence

    def to_dict(self) -> dict:
        return asdict(self)


def cache_stats(cache) -> CacheStats:
    """Measured occupancy of ``cache``."""
    return CacheStats(cache.mode, int(cache.batch_size or 0), int(cache.get_seq_length()), cache.num_banks(),
                      int(cache.kv_bytes()), int(cache.kv_bytes_per_token()))


def clone_cache(cache):
    """A deep copy of ``cache`` (the banks' valid tokens are copied; later writes to either
    copy do not affect the other)."""
    out = copy.copy(cache)
    out.banks = {key: bank.clone() for key, bank in cache.banks.items()}
    return out


def select_rows(cache, rows: torch.Tensor | list[int]):
    """A new cache whose batch rows are ``cache``'s ``rows`` (repeats allowed: ``[0]*k`` turns
    a one-sequence prefix into ``k`` copies). ``cache`` itself is left unchanged."""
    out = copy.copy(cache)
    idx = torch.as_tensor(rows, dtype=torch.long)
    out.banks = {}
    for key, bank in cache.banks.items():
        k, v = bank.view()
        i = idx.to(k.device)
        out.banks[key] = type(bank)(k.index_select(0, i), v.index_select(0, i))
    out.batch_size = int(idx.numel())
    return out


__all__ = ["MODES", "CacheStats", "MemoryReport", "banks_per_token", "cache_stats", "check_depth", "check_mode",
           "clone_cache", "held_depth", "kv_bytes_per_token", "memory_report", "new_cache", "select_rows",
           "terminal_over_per_visit"]
