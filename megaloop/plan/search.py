"""Evaluate one layout (memory + sampled steps) and rank the layouts of a GPU count.

``evaluate`` = worst-case memory per pipeline rank over the depth support, the peak over sampled
steps, and the step time / bubble / MFU over ``steps`` optimizer steps whose depths come from the
trainer's sampler (plus the same layout at a fixed depth equal to the law's mean, for the cost of
sampling). ``search`` enumerates TP x PP x VPP x micro-batch x recompute x SP, drops the layouts
the config rejects or that do not fit, and ranks the rest by predicted throughput.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from megaloop.config import RunConfig, load_config
from megaloop.config_utils import ConfigError
from megaloop.plan.cluster import ClusterSpec
from megaloop.plan.cost import CostModel, summarize
from megaloop.plan.layout import Layout, depth_mean, depth_plans, depth_support, fixed_depth_plans, make_layout
from megaloop.plan.memory import GiB, MemoryModel, stage_names


@dataclass
class Plan:
    """Predictions for one layout. Memory in bytes, times in seconds."""

    cfg: RunConfig
    layout: Layout
    cluster: ClusterSpec
    vocab: int
    memory: list[dict] = field(default_factory=list)  # per pipeline rank, worst case over the depth support
    sampled_peak: dict = field(default_factory=dict)  # per-step largest rank total over sampled steps
    steps: dict = field(default_factory=dict)  # summaries: step_s, bubble, mfu (+ parts)
    fixed: dict = field(default_factory=dict)  # the same at fixed depth = mean depth
    mean_depth: float = 0.0
    mm: MemoryModel | None = field(default=None, repr=False)

    @property
    def largest(self) -> dict:
        return max(self.memory, key=lambda r: r["total"])

    @property
    def fits(self) -> bool:
        return self.largest["total"] <= self.cluster.gpu_memory_gib * GiB


def memory_plan(cfg: RunConfig, layout: Layout, cluster: ClusterSpec, vocab: int) -> Plan:
    """Worst-case memory of every pipeline rank (all in-flight microbatches at their worst depth)."""
    mm = MemoryModel(cfg, layout, cluster, vocab)
    support = depth_support(cfg)
    plan = Plan(cfg, layout, cluster, vocab)
    plan.mm = mm
    for k in range(layout.pp):
        row = mm.rank_total(k, mm.rank_worst(k, support))
        row.update(rank=k, stages=stage_names(layout, k, cfg.model.looped))
        detail = []
        for c in range(layout.vpp):  # one microbatch at the stage's worst depth, by part
            v = c * layout.pp + k
            r = max(support, key=lambda d: mm.held(v, d))
            detail.append({"stage": v, "worst_depth": r, **mm.held_parts(v, r),
                           "no_grad_working_set": max(mm.transient("F", v, d) for d in support)})
        row["per_microbatch"] = detail
        plan.memory.append(row)
    plan.mean_depth = depth_mean(cfg)
    return plan


def evaluate(cfg: RunConfig, layout: Layout, cluster: ClusterSpec, vocab: int, steps: int = 32,
             plan: Plan | None = None, sampled_memory: bool = True) -> Plan:
    """Memory (worst case and, with ``sampled_memory``, over the sampled steps) and step statistics."""
    plan = plan or memory_plan(cfg, layout, cluster, vocab)
    cost = CostModel(cfg, layout, cluster, vocab, memory=plan.mm)
    mm = cost.mem
    plans = depth_plans(cfg, layout.microbatches, steps)
    ests = [cost.step(p) for p in plans]
    if sampled_memory:
        peaks = [max(mm.rank_total(k, mm.rank_peak(k, p))["total"] for k in range(layout.pp)) for p in plans]
        plan.sampled_peak = summarize(peaks)
    plan.steps = _summ(cost, ests)
    fixed_r = max(1, round(plan.mean_depth))
    plan.fixed = _summ(cost, [cost.step(p) for p in fixed_depth_plans(fixed_r, layout.microbatches, 1)])
    plan.fixed["depth"] = fixed_r
    return plan


def _summ(cost: CostModel, ests) -> dict:
    return {"step_s": summarize([e.step_s for e in ests]), "bubble": summarize([e.bubble for e in ests]),
            "imbalance": summarize([e.sim.imbalance for e in ests]),
            "mfu": summarize([cost.mfu(e) for e in ests]),
            "pipeline_s": summarize([e.pipeline_s for e in ests]), "dp_s": ests[0].dp_s,
            "core_sync_s": ests[0].core_sync_s, "optimizer_s": ests[0].optimizer_s,
            # throughput over the steps: total tokens / total time
            "tokens_per_s": cost.cfg.train.global_batch_size * cost.cfg.model.seq_len
            / statistics.fmean(e.step_s for e in ests)}


def _divisors(n: int, cands) -> list[int]:
    return [c for c in cands if c <= n and n % c == 0]


def candidates(cfg: RunConfig, world: int, gpus_per_node: int, min_pp: int = 1) -> list[list[str]]:
    """Layout override sets to try for ``world`` GPUs (TP within a node, PP >= ``min_pp``)."""
    out = []
    m = cfg.model
    for tp in _divisors(world, (1, 2, 4, 8)):
        if tp > gpus_per_node or m.num_heads % tp:
            continue
        for pp in _divisors(world // tp, (1, 2, 4, 8, 16, 32)):
            if pp < min_pp:
                continue
            for vpp in ((1, 2, 4) if pp > 2 else (1,)):
                for mbs in (1, 2, 4, 8):
                    for recompute in (False, True):
                        if recompute and m.fp8:
                            continue
                        for sp in ((False, True) if tp > 1 else (False,)):
                            out.append([f"parallel.tp={tp}", f"parallel.pp={pp}",
                                        f"parallel.vpp={vpp if vpp > 1 else 'null'}",
                                        f"train.micro_batch_size={mbs}", f"model.recompute={str(recompute).lower()}",
                                        f"parallel.sequence_parallel={str(sp).lower()}"])
    return out


def search(config: str, overrides: list[str], cluster: ClusterSpec, world: int, vocab: int,
           steps: int = 8, arm: str | None = None, top: int = 10, min_pp: int = 1) -> tuple[list[Plan], dict]:
    """Ranked fitting layouts (best predicted tokens/s first) and counts of the excluded ones: every
    fitting layout is timed over a few sampled steps, the best ``max(3·top, 20)`` again over ``steps``."""
    fitting, excluded = [], {"config": 0, "memory": 0}
    seen = set()
    for ov in candidates(load_config(config, overrides, arm=arm), world, cluster.gpus_per_node, min_pp):
        try:
            cfg = load_config(config, list(overrides) + ov, arm=arm)
            layout = make_layout(cfg, world)
        except ConfigError:
            excluded["config"] += 1
            continue
        if layout in seen:
            continue
        seen.add(layout)
        mem = memory_plan(cfg, layout, cluster, vocab)
        if not mem.fits:
            excluded["memory"] += 1
            continue
        fitting.append(mem)
    def rank(plans: list[Plan]) -> list[Plan]:
        return sorted(plans, key=lambda p: (-p.steps["tokens_per_s"], p.largest["total"]))

    quick = rank([evaluate(p.cfg, p.layout, cluster, vocab, min(steps, 4), plan=p, sampled_memory=False)
                  for p in fitting])
    keep = max(3 * top, 20)
    best = rank([evaluate(p.cfg, p.layout, cluster, vocab, steps, plan=p, sampled_memory=False)
                 for p in quick[:keep]])
    return best + quick[keep:], excluded
