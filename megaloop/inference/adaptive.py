"""Adaptive per-token depth for the inference engine: exit policies from CLI options, depth logs.

The criteria and the decode step itself live in the export's remote code
(:mod:`megaloop.hf.adaptive_megaloop`) so that the HF folder and the engine run the same code:

* ``latent:ε`` — stop when ``‖hʳ − hʳ⁻¹‖ / ‖hʳ‖ < ε`` (no extra compute);
* ``kl:ε`` — stop when ``KL(pʳ ‖ pʳ⁻¹) < ε`` between successive readouts (one coda + head pass
  per recurrence);
* ``argmax:k`` — stop when the readout's top-1 token was the same for ``k`` recurrences (same
  readout cost);

always within ``min_depth ≤ depth ≤ max_depth`` (``min_depth ≥ 2``: criteria compare two
recurrences). Prefill stays a parallel pass at the prefill depth; adaptive depth applies to
one-token decode steps (generation, and token-by-token teacher-forced scoring).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from megaloop.config_utils import ConfigError
from megaloop.hf.adaptive_megaloop import CRITERIA, ExitPolicy, adaptive_decode

ROW_MODES = ("mask", "compact")


def exit_policy(spec: Union[str, ExitPolicy, None], *, min_depth: Optional[int] = None,
                max_depth: Optional[int] = None, default_max_depth: int = 8,
                finished_rows: str = "mask") -> Optional[ExitPolicy]:
    """CLI / API options → :class:`ExitPolicy` (None for ``spec`` None / ``""`` / ``"none"``).

    ``spec``: ``latent:1e-3`` | ``kl:1e-4`` | ``argmax:3``; ``max_depth`` defaults to
    ``default_max_depth`` (the decode depth) when None (0 is refused, not the default; a
    ``min_depth`` above the default cap is refused naming ``--min-depth``); ``finished_rows``:
    ``mask`` or ``compact``.
    Raises ConfigError naming ``--exit`` / ``--min-depth`` / ``--max-depth`` / ``--finished-rows``:
    the depths and rows are checked here; what :meth:`ExitPolicy.parse` (export code, which raises
    ``ValueError`` because it cannot import megaloop) still refuses is the criterion, ``--exit``."""
    if isinstance(spec, ExitPolicy):
        return spec
    if spec is None or str(spec).strip().lower() in ("", "none"):
        return None
    if finished_rows not in ROW_MODES:
        raise ConfigError(f"--finished-rows: one of {ROW_MODES}, got {finished_rows!r}")
    low = 2 if min_depth is None else min_depth
    high = default_max_depth if max_depth is None else max_depth  # an explicit 0 is refused below, not a default
    if int(low) != low or low < 2:
        raise ConfigError(f"--min-depth: must be an integer >= 2 (criteria compare successive recurrences), got {low}")
    if max_depth is None and int(high) == high and high < low:
        raise ConfigError(f"--min-depth {low}: above the default --max-depth (the decode depth, {high}); pass "
                          f"--max-depth >= {low}")
    if int(high) != high or high < low:
        raise ConfigError(f"--max-depth: must be an integer >= min_depth ({low}), got {high}")
    try:
        return ExitPolicy.parse(spec, min_depth=int(low), max_depth=int(high), compaction=finished_rows == "compact")
    except ValueError as err:
        raise ConfigError(f"--exit: {err}") from None


@dataclass
class DepthLog:
    """Per-token depths of adaptive decode steps (one entry per fed token), and the compute
    actually spent (``row_recurrences``: (row, recurrence) core evaluations, masking included)."""

    counts: Counter = field(default_factory=Counter)
    row_recurrences: int = 0

    def add(self, depths: torch.Tensor, row_recurrences: int = 0) -> None:
        self.counts.update(int(d) for d in depths.reshape(-1).tolist())
        self.row_recurrences += int(row_recurrences)

    @property
    def tokens(self) -> int:
        return sum(self.counts.values())

    @property
    def mean(self) -> Optional[float]:
        n = self.tokens
        return sum(d * c for d, c in self.counts.items()) / n if n else None

    @property
    def histogram(self) -> dict[int, int]:
        """depth → number of tokens that stopped there (sorted by depth)."""
        return dict(sorted(self.counts.items()))

    def reset(self) -> None:
        self.counts.clear()
        self.row_recurrences = 0

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "mean_depth": self.mean, "histogram": self.histogram,
                "row_recurrences": self.row_recurrences,
                "compute_over_useful": (self.row_recurrences / sum(d * c for d, c in self.counts.items())
                                        if self.tokens else None)}

    def summary(self) -> str:
        """One line: mean depth and the histogram, e.g. ``mean depth 5.21 over 96 tokens; 2:10 3:40 …``."""
        if not self.tokens:
            return "no adaptive decode steps"
        hist = " ".join(f"{d}:{c}" for d, c in self.histogram.items())
        return f"mean depth {self.mean:.2f} over {self.tokens} tokens; depth:tokens {hist}"


__all__ = ["CRITERIA", "DepthLog", "ExitPolicy", "ROW_MODES", "adaptive_decode", "exit_policy"]
