"""Evaluate one layout (memory + sampled steps) and rank the layouts of a GPU count.

``evaluate`` = worst-case memory per pipeline rank over the depth support, the peak over sampled
steps, and the step time / bubble / MFU over ``steps`` optimizer steps whose depths come from the
trainer's sampler (plus the same layout at a fixed depth equal to the law's mean, for the cost of
sampling). ``search`` enumerates TP x PP x VPP x micro-batch x recompute x SP (the ones the caller
fixes held fixed), drops the layouts the config rejects or that do not fit, and ranks the rest by
expected throughput.

Throughput and MFU (one estimate, so they cannot contradict). A step's work depends on the depths
it draws, and layouts with different microbatch counts draw different depths, so the plain mean
of sampled step times ranks layouts by which depths they happened to draw. Instead:

    E[step time] = R x E[X] + fixed,   R = sum(makespan) / sum(X) over the sampled steps,

where ``X`` = a step's compute per pipeline rank (the sum of its F/B op times over all virtual
stages / pp), whose expectation ``E[X]`` over the depth law is computed exactly
(:meth:`CostModel.expected_microbatch`), and ``fixed`` = DP reduce + core sync + optimizer.
``R >= 1`` is the pipeline's stretch (1 / (1 - bubble), aggregated over the steps): exactly 1
without pipelining (PP1: no sampling noise at all), and the only sampled part with it (a ratio
estimator with ``X`` as control variate). Then tokens/s = global batch x seq / E[step time] and
MFU = E[model FLOPs per step] / (E[step time] x GPUs x peak): E[model FLOPs per step] does not
depend on the layout (model FLOPs per token at the same depth law and vocabulary; recompute is
not counted), so within one search (one precision, one peak) MFU is tokens/s times a constant
and both rank alike. ``tokens_per_s_se`` is the estimate's standard error (delta method on
``R``); :func:`ties` says which top rows are within two of them of the first. Every layout
draws its depths from the trainer's own sampler for the same steps (seed, step), so layouts
share the draws as far as their microbatch counts allow (common random numbers: the M draws of a
step are the first M of one stream).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megaloop.config import RunConfig, load_config
from megaloop.config_utils import ConfigError
from megaloop.plan.cluster import ClusterSpec
from megaloop.plan.cost import CostModel, StepEstimate, summarize
from megaloop.plan.layout import (Layout, depth_law, depth_mean, depth_plans, depth_support, fixed_depth_plans,
                                  make_layout)
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
    steps: dict = field(default_factory=dict)  # summaries: step_s, bubble, mfu (+ parts), expected throughput
    fixed: dict = field(default_factory=dict)  # the same at fixed depth = mean depth
    mean_depth: float = 0.0
    vocab_source: str = ""
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
             plan: Plan | None = None, sampled_memory: bool = True, cost: CostModel | None = None) -> Plan:
    """Memory (worst case and, with ``sampled_memory``, over the sampled steps) and step statistics."""
    plan = plan or memory_plan(cfg, layout, cluster, vocab)
    cost = cost or CostModel(cfg, layout, cluster, vocab, memory=plan.mm)
    mm = cost.mem
    plans = depth_plans(cfg, layout.microbatches, steps)
    ests = [cost.step(p) for p in plans]
    if sampled_memory:
        peaks = [max(mm.rank_total(k, mm.rank_peak(k, p))["total"] for k in range(layout.pp)) for p in plans]
        plan.sampled_peak = summarize(peaks)
    plan.steps = _summ(cost, ests, depth_law(cfg))
    fixed_r = max(1, round(plan.mean_depth))
    plan.fixed = _summ(cost, [cost.step(p) for p in fixed_depth_plans(fixed_r, layout.microbatches, 1)],
                       [(fixed_r, 1.0)])
    plan.fixed["depth"] = fixed_r
    return plan


def expected_step(cost: CostModel, ests: list[StepEstimate], law: list[tuple[int, float]]) -> dict:
    """Expected step time, tokens/s and MFU of ``cost``'s layout over the depth law, from the
    sampled steps ``ests`` (module docstring: ratio estimator, exact without pipelining)."""
    L, cfg = cost.layout, cost.cfg
    work, flops = cost.expected_microbatch(law)
    ex = L.microbatches * work / L.pp  # E[X]: compute per pipeline rank and step
    xs = [sum(e.sim.busy) / L.pp for e in ests]
    ys = [e.sim.makespan for e in ests]
    n = len(ests)
    ratio = sum(ys) / sum(xs) if sum(xs) > 0 else 1.0
    if L.pp == 1:  # no pipeline: the makespan is the compute; nothing sampled remains
        ratio, se_ratio = 1.0, 0.0
    elif len(law) == 1:  # one depth: every step is the same step
        se_ratio = 0.0
    elif n > 1:
        xbar = sum(xs) / n
        se_ratio = math.sqrt(sum((y - ratio * x) ** 2 for x, y in zip(xs, ys)) / (n * (n - 1))) / xbar
    else:
        se_ratio = math.inf  # one step: no estimate of the noise
    step_s = ratio * ex + cost.fixed_s()
    tokens = cfg.train.global_batch_size * cfg.model.seq_len
    tps = tokens / step_s
    step_flops = flops * L.microbatches * L.dp
    return {"step_s": step_s, "tokens_per_s": tps,
            "tokens_per_s_se": tps * ex * se_ratio / step_s if math.isfinite(se_ratio) else None,
            "mfu": step_flops / (step_s * L.world * cost.peak_flops()),
            "mfu_vs_bf16": step_flops / (step_s * L.world * cost.cluster.peak_bf16_tflops * 1e12),
            "model_flops_per_step": step_flops, "stretch": ratio, "compute_per_rank_s": ex, "steps": n}


def _summ(cost: CostModel, ests: list[StepEstimate], law: list[tuple[int, float]]) -> dict:
    exp = expected_step(cost, ests, law)
    return {"step_s": summarize([e.step_s for e in ests]), "bubble": summarize([e.bubble for e in ests]),
            "imbalance": summarize([e.sim.imbalance for e in ests]),
            "mfu": summarize([cost.mfu(e) for e in ests]),  # per sampled step (its spread)
            "pipeline_s": summarize([e.pipeline_s for e in ests]), "dp_s": ests[0].dp_s,
            "core_sync_s": ests[0].core_sync_s, "optimizer_s": ests[0].optimizer_s,
            "peak_tflops": cost.peak_flops() / 1e12, "peak_precision": "fp8" if cost.layout.fp8 else "bf16",
            # expected over the depth law (what the search ranks by; module docstring)
            "expected": exp, "tokens_per_s": exp["tokens_per_s"]}


def _divisors(n: int, cands) -> list[int]:
    return [c for c in cands if c <= n and n % c == 0]


def candidates(cfg: RunConfig, world: int, gpus_per_node: int, min_pp: int = 1,
               fixed: dict | None = None) -> list[list[str]]:
    """Layout override sets to try for ``world`` GPUs (TP within a node, PP >= ``min_pp``).
    ``fixed`` (keys ``tp pp vpp mbs recompute sp dp``) holds a knob at the caller's value; a fixed
    value is tried even where the search would not (``--tp 16``, ``--mbs 32``)."""
    fixed = fixed or {}
    out = []
    m = cfg.model

    def opts(key: str, default):
        return (fixed[key],) if key in fixed else default

    for tp in opts("tp", _divisors(world, (1, 2, 4, 8))):
        if "tp" not in fixed and (tp > gpus_per_node or m.num_heads % tp):
            continue
        for pp in opts("pp", _divisors(world // tp, (1, 2, 4, 8, 16, 32))):
            if pp < min_pp or ("dp" in fixed and tp * pp * fixed["dp"] != world):
                continue
            for vpp in opts("vpp", (1, 2, 4) if pp > 2 else (1,)):
                for mbs in opts("mbs", (1, 2, 4, 8)):
                    for recompute in opts("recompute", (False, True)):
                        if recompute and m.fp8 and "recompute" not in fixed:
                            continue
                        for sp in opts("sp", (False, True) if tp > 1 else (False,)):
                            out.append([f"parallel.tp={tp}", f"parallel.pp={pp}",
                                        f"parallel.vpp={vpp if vpp > 1 else 'null'}",
                                        f"train.micro_batch_size={mbs}", f"model.recompute={str(recompute).lower()}",
                                        f"parallel.sequence_parallel={str(sp).lower()}"])
    return out


def _rule(err: ConfigError) -> str:
    """The field a config error names (``train.global_batch_size: ...`` -> ``train.global_batch_size``)."""
    text = str(err)
    head = text.split(":", 1)[0].strip()
    return head if head and " " not in head else text[:60]


def search(config: str, overrides: list[str], cluster: ClusterSpec, world: int, vocab: int,
           steps: int = 32, arm: str | None = None, top: int = 10, min_pp: int = 1,
           fixed: dict | None = None) -> tuple[list[Plan], dict]:
    """The ``top`` fitting layouts by expected tokens/s (best first; ties by memory) and the counts:
    ``excluded`` = {``config``, ``memory``, ``rules``: excluded per config field, ``examples``: one
    message per field, ``fitting``, ``simulated``}.

    Every fitting layout gets an upper bound of its expected tokens/s without sampling
    (:meth:`CostModel.expected_step_bound`: its compute per rank plus the pipeline's fill and
    drain at expected op times; exact without pipelining); layouts are simulated over ``steps``
    sampled steps in the order of that bound until the next bound is below the ``top``-th best
    estimate: a layout left out cannot be expected to reach the listed ones."""
    fitting: list[Plan] = []
    excluded: dict = {"config": 0, "memory": 0, "rules": {}, "examples": {}}
    seen = set()
    for ov in candidates(load_config(config, overrides, arm=arm), world, cluster.gpus_per_node, min_pp, fixed):
        try:
            cfg = load_config(config, list(overrides) + ov, arm=arm)
            layout = make_layout(cfg, world)
        except ConfigError as err:
            excluded["config"] += 1
            rule = _rule(err)
            excluded["rules"][rule] = excluded["rules"].get(rule, 0) + 1
            text = str(err)
            excluded["examples"].setdefault(rule, text[len(rule) + 1:].strip() if text.startswith(rule + ":") else text)
            continue
        if layout in seen:
            continue
        seen.add(layout)
        mem = memory_plan(cfg, layout, cluster, vocab)
        if not mem.fits:
            excluded["memory"] += 1
            least = excluded.get("least_memory_gib")
            excluded["least_memory_gib"] = min(least or math.inf, mem.largest["total"] / GiB)
            continue
        fitting.append(mem)
    excluded["fitting"] = len(fitting)
    if not fitting:
        return [], excluded
    law = depth_law(fitting[0].cfg)
    bounded = []
    for p in fitting:
        cost = CostModel(p.cfg, p.layout, cluster, vocab, memory=p.mm)
        tokens = p.cfg.train.global_batch_size * p.cfg.model.seq_len
        bounded.append((tokens / cost.expected_step_bound(law), p, cost))
    bounded.sort(key=lambda b: (-b[0], b[1].largest["total"]))

    def key(p: Plan):
        return (-p.steps["tokens_per_s"], p.largest["total"])

    done: list[Plan] = []
    for bound, p, cost in bounded:
        if len(done) >= top and bound < sorted(done, key=key)[top - 1].steps["tokens_per_s"]:
            break
        done.append(evaluate(p.cfg, p.layout, cluster, vocab, steps, plan=p, sampled_memory=False, cost=cost))
    excluded["simulated"] = len(done)
    return sorted(done, key=key)[:top], excluded


def within_noise(a: Plan, b: Plan, sigmas: float = 2.0) -> bool:
    """Whether two layouts' expected tokens/s differ by no more than ``sigmas`` standard errors of
    the difference (the simulation's sampling noise; a layout simulated over one step has none
    estimated and is within the noise of anything)."""
    ea, eb = a.steps["expected"], b.steps["expected"]
    se = (ea["tokens_per_s_se"], eb["tokens_per_s_se"])
    if None in se:
        return True
    return abs(ea["tokens_per_s"] - eb["tokens_per_s"]) <= sigmas * math.hypot(*se)


def ties(plans: list[Plan], sigmas: float = 2.0) -> list[tuple[int, int]]:
    """Runs of consecutive rows (1-based, inclusive) whose neighbours are within the noise of each
    other (:func:`within_noise`): the order inside a run is not a prediction."""
    runs, start = [], 0
    for i in range(1, len(plans) + 1):
        if i == len(plans) or not within_noise(plans[i - 1], plans[i], sigmas):
            if i - start > 1:
                runs.append((start + 1, i))
            start = i
    return runs
