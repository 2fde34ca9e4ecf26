"""KV banks of the pure-PyTorch megaloop model (SPEC §7): terminal sharing or per-visit banks.

Part of the exported ``trust_remote_code`` folder: imports only torch and the standard library.
See modeling_megaloop.py for how a forward fills and reads the banks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from .configuration_megaloop import MegaloopConfig


def one_cache(past_key_values, cache):
    """The cache passed under either name: ``past_key_values`` (transformers 4.x, 5.x) or ``cache``
    (the name recent transformers 5.x use in generate() and model outputs)."""
    if past_key_values is not None and cache is not None and past_key_values is not cache:
        raise ValueError("pass the cache as past_key_values or as cache, not both")
    return cache if cache is not None else past_key_values


class _Bank:
    """Growable K/V storage [b, kv_heads, capacity, hd] of one bank; ``n`` tokens are valid."""

    __slots__ = ("k", "v", "n")

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v, self.n = k.contiguous(), v.contiguous(), k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        s = k.shape[2]
        if self.n + s > self.k.shape[2]:
            cap = max(self.n + s, 2 * self.k.shape[2], 16)
            for name in ("k", "v"):
                old = getattr(self, name)
                new = old.new_empty(old.shape[0], old.shape[1], cap, old.shape[3])
                new[:, :, :self.n] = old[:, :, :self.n]
                setattr(self, name, new)
        self.k[:, :, self.n:self.n + s] = k
        self.v[:, :, self.n:self.n + s] = v
        self.n += s

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[:, :, :self.n], self.v[:, :, :self.n]

    def clone(self) -> "_Bank":
        k, v = self.view()
        return _Bank(k.clone(), v.clone())

    def nbytes(self) -> int:
        k, v = self.view()
        return k.numel() * k.element_size() + v.numel() * v.element_size()


class MegaloopCache:
    """KV banks of a megaloop model (SPEC §7), filled in place by the model's forward.

    Banks are keyed ``(group, index, visit)`` with group ``prelude`` / ``core`` / ``coda`` /
    ``layers`` (untied); ``visit`` is 0 except for core banks in ``per_visit`` mode. Each bank
    holds post-rotary keys and values [batch, kv_heads, tokens, head_dim].

    Use: ``cache = model.new_cache("terminal")``; ``model(prompt, past_key_values=cache,
    num_recurrences=P)`` (prefill); then ``model(next_token, past_key_values=cache,
    num_recurrences=D)`` per decoded token. ``generate`` creates one from ``config.kv_cache_mode``.
    """

    # Flags transformers' generate() reads on its caches (5.x): never compiled around, no past-recording
    # rollback (so no deferred stop checks / assisted decoding), attention (not linear-recurrent) layers.
    is_compileable = False
    is_croppable = False
    is_linear = (False,)

    def __init__(self, config: MegaloopConfig, mode: Optional[str] = None):
        self.mode = mode or config.kv_cache_mode
        if self.mode not in ("terminal", "per_visit"):
            raise ValueError(f"kv_cache_mode: unknown mode {self.mode!r}; one of ('terminal', 'per_visit')")
        self.looped = config.looped
        self.n_core = config.n_core if config.looped else 0
        self.banks: dict[tuple[str, int, int], _Bank] = {}
        self.visits = 0  # core visit banks per layer (per_visit); 1 in terminal mode once filled
        self.length = 0
        self.batch_size: Optional[int] = None
        self.exit_depths: list[torch.Tensor] = []  # adaptive decode steps: per-row depths [b] (CPU)

    # ------------------------------------------------------------ HF cache protocol
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def get_max_cache_shape(self) -> Optional[int]:
        return None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for bank in self.banks.values():
            k, v = bank.view()
            idx = beam_idx.to(k.device)
            bank.k, bank.v = k.index_select(0, idx), v.index_select(0, idx)
        self.exit_depths = [d.index_select(0, beam_idx.cpu()) for d in self.exit_depths]
        self.batch_size = int(beam_idx.numel())

    def crop(self, max_length: int) -> None:
        """Drop every token from position ``max_length`` on."""
        if max_length < 0:
            max_length = self.length + max_length
        for bank in self.banks.values():
            bank.n = min(bank.n, max_length)
        self.length = min(self.length, max_length)

    # ------------------------------------------------------------ reads / writes
    def read(self, group: str, index: int, recurrence: int = 0) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """Prefix K/V that layer ``(group, index)`` attends to at ``recurrence``; None if empty."""
        if self.length == 0:
            return None
        visit = 0
        if group == "core" and self.mode == "per_visit":
            visit = min(recurrence, self.visits - 1)
        return self.banks[(group, index, visit)].view()

    def commit(self, new: dict, depth: int, num_new: int) -> None:
        """Append the new tokens' banks. ``new[(group, i, r)] = (k, v)``; core entries for the
        recurrences this mode keeps (terminal: ``depth-1``; per_visit: all)."""
        for (group, i, r), (k, v) in new.items():
            if group != "core":
                self._append((group, i, 0), k, v)
        if self.n_core:
            if self.mode == "terminal":
                for i in range(self.n_core):
                    self._append(("core", i, 0), *new[("core", i, depth - 1)])
                self.visits = 1
            else:
                old = self.visits
                total = max(old, depth)
                for visit in range(old, total):  # cached tokens read their deepest visit there
                    for i in range(self.n_core):
                        if old and self.length:
                            self.banks[("core", i, visit)] = self.banks[("core", i, old - 1)].clone()
                for visit in range(total):
                    for i in range(self.n_core):
                        self._append(("core", i, visit), *new[("core", i, min(visit, depth - 1))])
                self.visits = total
        self.length += num_new

    def _append(self, key: tuple[str, int, int], k: torch.Tensor, v: torch.Tensor) -> None:
        bank = self.banks.get(key)
        if bank is None:
            self.banks[key] = _Bank(k, v)
        else:
            bank.append(k, v)

    # ------------------------------------------------------------ accounting
    def num_banks(self) -> int:
        """KV banks held per token (physical-layer banks, incl. every per-visit core bank)."""
        return len(self.banks)

    def kv_bytes(self) -> int:
        """Bytes of keys and values held (valid tokens only, all sequences of the batch)."""
        return sum(b.nbytes() for b in self.banks.values())

    def kv_bytes_per_token(self) -> int:
        """Bytes held per cached token of one sequence."""
        if not self.length:
            return 0
        return self.kv_bytes() // (self.length * (self.batch_size or 1))
