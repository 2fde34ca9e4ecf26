"""Training-depth distributions, the learned depth prior and the rank-synchronised sampler (SPEC §4–§5).

Exports are loaded lazily so that importing :class:`DepthConfig` (config parsing) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from megaloop.depth.config import DEPTH_KINDS, PRIOR_INITS, REWARD_ARMS, DepthConfig

_LAZY = {
    "DepthDistribution": "distributions",
    "fixed": "distributions",
    "pln": "distributions",
    "pln_mu": "distributions",
    "pln_probs": "distributions",
    "poisson": "distributions",
    "poisson_probs": "distributions",
    "sample_categorical": "distributions",
    "LearnedDepthPrior": "prior",
    "DepthSampler": "sampler",
    "assert_plan_synchronised": "sampler",
    "step_seed": "sampler",
}

__all__ = ["DEPTH_KINDS", "PRIOR_INITS", "REWARD_ARMS", "DepthConfig", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"megaloop.depth.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'megaloop.depth' has no attribute {name!r}")
