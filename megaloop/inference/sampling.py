"""Token selection for generation: greedy, temperature, top-k / top-p sampling."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch

from megaloop.config_utils import ConfigError


@dataclass
class SamplingParams:
    """``temperature == 0`` (or ``greedy``) → argmax; else softmax(logits/T) after top-k / top-p."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None
    greedy: bool = field(init=False, default=True)

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ConfigError(f"--temperature: must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"--top-k: must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"--top-p: must be in (0, 1], got {self.top_p}")
        self.greedy = self.temperature == 0


def row_generators(seed: int, rows: int, device="cpu") -> list[torch.Generator]:
    """One sampling stream per batch row, seeded from (``seed``, row): a row's sample depends on its
    prompt, the seed and its place in the batch only, not on the other rows or when they finish."""
    gens = []
    for row in range(rows):
        digest = hashlib.sha256(f"megaloop-sample:{int(seed)}:{row}".encode()).digest()
        gens.append(torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little") >> 1))
    return gens


def pick_tokens(logits: torch.Tensor, params: SamplingParams,
                generator: Optional[Union[torch.Generator, Sequence[torch.Generator]]]) -> torch.Tensor:
    """Next tokens [b] from logits [b, V] (the real vocabulary); ``generator`` one stream for the batch
    or one per row (:func:`row_generators`)."""
    if params.greedy:
        return logits.argmax(-1)
    logits = logits.double()  # FP64: a temperature below FP32's range (5e-324) is not a division by zero
    # shifted so the best is 0 before dividing: a tiny temperature (1e-39) sent logits / T to ±inf and the
    # softmax to NaN (a multinomial traceback); shifted, the others go to -inf and the best keeps it all
    scores = (logits - logits.max(-1, keepdim=True).values) / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        probs = sorted_scores.softmax(-1)
        drop = probs.cumsum(-1) - probs > params.top_p  # keep the smallest set reaching top_p
        drop[:, 0] = False
        scores = scores.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    probs = scores.softmax(-1)
    if generator is None or isinstance(generator, torch.Generator):
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return torch.stack([torch.multinomial(probs[i], 1, generator=g)[0] for i, g in enumerate(generator)])


__all__ = ["SamplingParams", "pick_tokens", "row_generators"]
