"""A training layout (TP, PP, VPP, DP, micro-batch, recompute, distributed optimizer, FP8) checked
against a run config and a world size, and the run's depth distribution.

The layout lives in the run config itself (``parallel.*``, ``train.micro_batch_size``,
``model.recompute``, ``model.fp8``); :func:`layout_overrides` turns layout flags into the
project's dotlist overrides, so the planner validates exactly what ``megaloop train`` would.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from megaloop.config import RunConfig
from megaloop.config_utils import ConfigError, require


@dataclass(frozen=True)
class Layout:
    """Parallel layout of one run. ``microbatches`` = microbatches per optimizer step and DP rank."""

    world: int
    tp: int
    pp: int
    vpp: int
    dp: int
    micro_batch: int
    microbatches: int
    recompute: bool
    distributed_optimizer: bool
    fp8: bool
    sequence_parallel: bool

    @property
    def stages(self) -> int:
        return self.pp * self.vpp

    def short(self) -> str:
        s = f"TP{self.tp} PP{self.pp}" + (f" VPP{self.vpp}" if self.vpp > 1 else "") + f" DP{self.dp} mbs{self.micro_batch}"
        flags = [f for f, on in (("SP", self.sequence_parallel), ("recompute", self.recompute),
                                 ("FP8", self.fp8), ("no-distopt", not self.distributed_optimizer)) if on]
        return s + (" " + " ".join(flags) if flags else "")


def layout_overrides(tp: int | None = None, pp: int | None = None, vpp: int | None = None,
                     mbs: int | None = None, recompute: bool | None = None, dist_opt: bool | None = None,
                     fp8: str | None = None, sp: bool | None = None) -> list[str]:
    """Layout flags -> dotlist overrides of the run config (None = keep the config's value)."""
    out = []
    for key, val in (("parallel.tp", tp), ("parallel.pp", pp), ("parallel.vpp", vpp),
                     ("train.micro_batch_size", mbs), ("model.recompute", recompute),
                     ("parallel.distributed_optimizer", dist_opt), ("parallel.sequence_parallel", sp)):
        if val is not None:
            out.append(f"{key}={str(val).lower() if isinstance(val, bool) else val}")
    if fp8 is not None:
        out.append(f"model.fp8={'null' if fp8 in ('', 'none', 'off') else fp8}")
    return out


def make_layout(cfg: RunConfig, world: int) -> Layout:
    """Check ``cfg``'s layout against ``world`` GPUs (the trainer's own rules); ConfigError naming
    the field otherwise."""
    par = cfg.parallel
    require(world >= 1, "--gpus", f"must be >= 1, got {world}")
    if world % (par.tp * par.pp):
        raise ConfigError(f"parallel: world size {world} is not divisible by tp*pp = "
                          f"{par.tp}*{par.pp} = {par.tp * par.pp}")
    dp = world // (par.tp * par.pp)
    vpp = par.vpp or 1
    m = cfg.train.num_microbatches(dp)
    if vpp > 1 and m % par.pp:
        raise ConfigError(f"train.global_batch_size: interleaved pipelining needs the {m} microbatches "
                          f"per step to be a multiple of parallel.pp={par.pp}")
    if not cfg.model.looped and cfg.model.num_layers % (par.pp * vpp):
        raise ConfigError(f"model.num_layers: {cfg.model.num_layers} layers do not split over "
                          f"{par.pp * vpp} pipeline stages")
    return Layout(world=world, tp=par.tp, pp=par.pp, vpp=vpp, dp=dp, micro_batch=cfg.train.micro_batch_size,
                  microbatches=m, recompute=cfg.model.recompute, distributed_optimizer=par.distributed_optimizer,
                  fp8=bool(cfg.model.fp8), sequence_parallel=par.sequence_parallel and par.tp > 1)


def depth_support(cfg: RunConfig) -> list[int]:
    """Depths the run can draw (probability > 0 under its depth law; the learned prior's initial one)."""
    return [d for d, _ in depth_law(cfg)]


def depth_law(cfg: RunConfig) -> list[tuple[int, float]]:
    """``(depth, probability)`` of every depth the run can draw (the learned prior's initial law);
    the exact expectation the planner's throughput estimate uses (``search._summ``)."""
    if cfg.depth.kind == "fixed":
        return [(cfg.depth.depth, 1.0)]
    p = _sampler(cfg).probs()
    total = float(p.sum())
    return [(i + 1, float(p[i]) / total) for i in range(p.numel()) if p[i] > 0]


def depth_plans(cfg: RunConfig, microbatches: int, steps: int, first_step: int = 0) -> list[list[int]]:
    """The depths of ``steps`` optimizer steps' microbatches, drawn by the trainer's own sampler
    (``DepthSampler.plan``; a learned prior at its initial distribution)."""
    sampler = _sampler(cfg)
    return [sampler.plan(first_step + i, microbatches) for i in range(steps)]


def depth_mean(cfg: RunConfig) -> float:
    """Mean depth of the run's (initial) law."""
    return float(_sampler(cfg).mean_depth())


def _sampler(cfg: RunConfig):
    """The trainer's depth sampler for ``cfg``; a learned prior with ``depth.init=from:PATH`` starts
    from PATH's prior as in training (``ConfigError`` naming the override for a PATH it cannot use)."""
    from megaloop.depth.sampler import DepthSampler

    init_state = None
    if cfg.depth.kind == "learned" and cfg.depth.init_from is not None:
        init_state = _prior_from(str(cfg.depth.init_from), cfg.depth.r_max)
    return DepthSampler(cfg.depth, cfg.train.seed, init_state=init_state)


@functools.lru_cache(maxsize=4)
def _prior_from(path: str, r_max: int) -> dict:
    from megaloop.train.prior_init import load_prior_init

    return load_prior_init(path, r_max)


def fixed_depth_plans(depth: int, microbatches: int, steps: int) -> list[list[int]]:
    return [[depth] * microbatches for _ in range(steps)]


__all__ = ["Layout", "depth_law", "depth_mean", "depth_plans", "depth_support", "fixed_depth_plans", "layout_overrides",
           "make_layout"]
