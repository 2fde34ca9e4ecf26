"""Rank-synchronised depth sampler (SPEC §4): one depth per microbatch, identical on every rank.

All depths of optimizer step ``n`` are drawn by :meth:`DepthSampler.plan` before the step runs, from
a ``torch.Generator`` seeded by ``(seed, step)`` and the current distribution. Every rank holds the
same seed and (after identical prior updates from all-reduced inputs) the same distribution, so the
plans agree without communication, and a resumed run redraws exactly the plans it would have drawn.
:func:`assert_plan_synchronised` checks that claim with one all-gather (debug / first steps).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from megaloop.config_utils import ConfigError
from megaloop.depth.config import DepthConfig
from megaloop.depth.distributions import DepthDistribution, fixed, pln, poisson, sample_categorical
from megaloop.depth.prior import LearnedDepthPrior, as_float64, per_depth_ce

__all__ = ["DepthSampler", "assert_plan_synchronised", "step_seed"]

_MASK64 = (1 << 64) - 1
_DEPTH_SALT = 0x6D65_6761_6C6F_6F70  # "megaloop": keeps this stream apart from other (seed, step) streams


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def step_seed(seed: int, step: int) -> int:
    """Well-mixed 63-bit generator seed for ``(seed, step)`` (pure integer maths: rank/platform independent)."""
    return _splitmix64(_splitmix64((int(seed) ^ _DEPTH_SALT) & _MASK64) ^ (int(step) & _MASK64)) >> 1


class DepthSampler:
    """Draws each optimizer step's microbatch depths and (for ``learned``) updates the prior.

    ``probs()`` has length ``cfg.max_depth`` (``depth`` / ``cap`` / ``r_max``), index ``k`` = depth ``k+1``.
    """

    def __init__(self, cfg: DepthConfig, seed: int, *, init_state: dict[str, Any] | None = None) -> None:
        """``init_state``: the learned prior's starting logits and support for ``depth.init=from:PATH``
        (the trainer reads them from the other run, ``megaloop.train.prior_init``; None on resume,
        where this run's checkpoint brings the prior)."""
        self.cfg = cfg
        self.seed = int(seed)
        self.prior: LearnedDepthPrior | None = None
        self.static: DepthDistribution | None = None
        if cfg.kind == "learned":
            self.prior = LearnedDepthPrior(cfg, init_state)
        elif cfg.kind == "pln":
            self.static = pln(cfg.mean, cfg.sigma, cfg.cap)
        elif cfg.kind == "poisson":
            self.static = poisson(cfg.mean, cfg.cap)
        else:
            self.static = fixed(cfg.depth)

    @property
    def kind(self) -> str:
        return self.cfg.kind

    def probs(self) -> torch.Tensor:
        """Current depth pmf, float64 ``[max_depth]``."""
        return self.prior.probs() if self.prior is not None else self.static.probs.clone()

    def mean_depth(self) -> float:
        return self.prior.mean_depth() if self.prior is not None else self.static.mean()

    def entropy(self) -> float:
        return self.prior.entropy() if self.prior is not None else self.static.entropy()

    def plan(self, step: int, num_microbatches: int) -> list[int]:
        """Depths of the ``num_microbatches`` microbatches of optimizer step ``step`` (1-based).

        ``depth.correlation=microbatch``: i.i.d. per microbatch; ``step``: one draw repeated for every
        microbatch of the step (the draw equals the first microbatch's draw under ``microbatch``).
        Pure function of ``(seed, step)`` and the current distribution; call it after the previous
        step's :meth:`update` so the learned prior's latest logits are used.
        """
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
        if self.cfg.kind == "fixed":
            return [self.cfg.depth] * num_microbatches
        gen = torch.Generator(device="cpu")
        gen.manual_seed(step_seed(self.seed, step))
        if self.cfg.correlation == "step":
            return sample_categorical(self.probs(), 1, gen) * num_microbatches
        return sample_categorical(self.probs(), num_microbatches, gen)

    def update(
        self,
        depths: Sequence[int],
        ce_sums: torch.Tensor | Sequence[float],
        counts: torch.Tensor | Sequence[float],
    ) -> dict[str, Any]:
        """Feed one optimizer step's global per-microbatch CE sums / target counts (shapes ``[M]``).

        ``learned``: runs the prior update and returns its metrics. ``fixed``/``pln``: nothing to
        learn; returns the static ``mean_depth``/``entropy``/``probs`` and the step's ``per_depth_ce``.
        """
        if self.prior is not None:
            return self.prior.update(depths, ce_sums, counts)
        s, n = as_float64(ce_sums), as_float64(counts)
        if not (len(depths) == s.numel() == n.numel()):
            raise ValueError(f"update needs equal-length depths/ce_sums/counts, got {len(depths)}/{s.numel()}/{n.numel()}")
        p = self.probs()
        return {
            "mean_depth": self.mean_depth(),
            "entropy": self.entropy(),
            "probs": p.tolist(),
            "per_depth_ce": per_depth_ce([int(d) for d in depths], s, n),
        }

    def state_dict(self) -> dict[str, Any]:
        """Sampler state: kind, seed (the whole RNG state, as draws are keyed by step) and the prior."""
        state: dict[str, Any] = {"kind": self.cfg.kind, "seed": self.seed}
        if self.prior is not None:
            state["prior"] = self.prior.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore; the checkpoint's seed wins (choice: exact resume redraws the same plans)."""
        if state["kind"] != self.cfg.kind:
            raise ConfigError(f"depth.kind: checkpoint sampler is {state['kind']!r}, config is {self.cfg.kind!r}")
        self.seed = int(state["seed"])
        if self.prior is not None:
            self.prior.load_state_dict(state["prior"])


def assert_plan_synchronised(plan: Sequence[int], group: Any = None) -> None:
    """All-gather ``plan`` over ``group`` and raise ``RuntimeError`` naming the first rank that differs.

    No-op when torch.distributed is unavailable or not initialised. Ranks are reported as
    group rank and global rank.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    mine = [int(r) for r in plan]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    ref = gathered[0]
    for rank, other in enumerate(gathered):
        if other != ref:
            global_rank = dist.get_global_rank(group, rank) if group is not None else rank
            raise RuntimeError(
                f"depth plan not synchronised: group rank {rank} (global rank {global_rank}) has {other}, "
                f"group rank 0 has {ref}"
            )
