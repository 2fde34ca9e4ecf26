"""In-context copying probe: does the model predict a token sequence better the second time it sees it?

Each probe sequence is ``n`` uniformly random token ids (no structure a model can learn from its
training data) followed by the same ``n`` ids again: ``[x_0 … x_{n-1}, x_0 … x_{n-1}]``, length 2n.
With ``CE_t`` the cross-entropy (nats) of predicting token ``t`` from the tokens before it:

- ``loss_first``: mean ``CE_t`` over t = 1 … n−1 (first occurrence: nothing to copy from);
- ``loss_repeat``: mean ``CE_t`` over t = n+1 … 2n−1 (every target and the token before it have
  appeared n positions earlier; t = n is left out, its context ``x_{n-1}`` never preceded ``x_0``);
- ``copy_gain = loss_first − loss_repeat`` (nats). Near 0: the model does not copy from its
  context; large (one to several nats): it has learned in-context copying, the behaviour of
  "induction heads" (Olsson et al., 2022), which language models acquire in a fairly sudden phase
  of training and which lowers their loss on natural text, where spans do repeat.

The probe needs only a ``logits_fn(ids [b, 2n] int64) -> logits [b, 2n, vocab]``, so one
measurement serves megaloop's models (any depth) and a reference implementation alike.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F


def repeated_random_tokens(num_seqs: int, half_len: int, vocab_size: int, *, seed: int = 0,
                           exclude: Sequence[int] = ()) -> torch.Tensor:
    """``[num_seqs, 2 * half_len]`` int64: ids drawn uniformly from ``[0, vocab_size)`` less
    ``exclude`` (special tokens such as EOS, so that no probe sequence carries a document boundary),
    with a generator seeded by ``seed`` (the same probe for every model); each row repeated once."""
    if num_seqs < 1 or half_len < 2:
        raise ValueError(f"copy probe: num_seqs must be >= 1 and half_len >= 2, got {num_seqs}, {half_len}")
    drop = torch.zeros(vocab_size, dtype=torch.bool)
    drop[[i for i in exclude if 0 <= i < vocab_size]] = True
    allowed = (~drop).nonzero().flatten()
    if len(allowed) < 2:
        raise ValueError(f"copy probe: fewer than 2 token ids left of vocab_size {vocab_size} after excluding {list(exclude)}")
    g = torch.Generator().manual_seed(seed)
    x = allowed[torch.randint(0, len(allowed), (num_seqs, half_len), generator=g)]
    return torch.cat([x, x], dim=1)


def copy_scores(logits: torch.Tensor, ids: torch.Tensor) -> dict:
    """``loss_first``, ``loss_repeat`` and ``copy_gain`` (module docstring) of ``logits`` [b, 2n, V]
    computed on ``ids`` [b, 2n] made by :func:`repeated_random_tokens`."""
    b, s = ids.shape
    if s % 2 or logits.shape[:2] != ids.shape:
        raise ValueError(f"copy probe: ids must be [b, 2n] and logits [b, 2n, vocab]; got ids {tuple(ids.shape)}, "
                         f"logits {tuple(logits.shape)}")
    n = s // 2
    # ce[:, t - 1] predicts token t from the tokens before it
    ce = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten(), reduction="none").view(b, s - 1)
    first = ce[:, : n - 1].mean()
    repeat = ce[:, n:].mean()
    return {"loss_first": float(first), "loss_repeat": float(repeat), "copy_gain": float(first - repeat),
            "num_seqs": b, "half_len": n}


@torch.no_grad()
def copy_probe(logits_fn: Callable[[torch.Tensor], torch.Tensor], vocab_size: int, *, num_seqs: int = 16,
               half_len: int = 64, seed: int = 0, exclude: Sequence[int] = ()) -> dict:
    """Run ``logits_fn`` on the probe sequences and return :func:`copy_scores` plus the probe's
    ``seed``. ``half_len`` must fit the model's context twice (2 · half_len tokens)."""
    ids = repeated_random_tokens(num_seqs, half_len, vocab_size, seed=seed, exclude=exclude)
    return {**copy_scores(logits_fn(ids), ids), "seed": seed}
