"""Text and JSON renderings of planner results (GiB, ms, percent)."""

from __future__ import annotations

import copy

from megaloop.config import RunConfig
from megaloop.plan.cluster import ClusterSpec
from megaloop.plan.cost import CostModel, summarize
from megaloop.plan.layout import Layout, depth_mean, depth_plans, fixed_depth_plans
from megaloop.plan.memory import GiB
from megaloop.plan.pipeline_sim import textbook_bubble
from megaloop.plan.search import Plan

NOTE = ("predictions: GPU constants of the cost model (efficiencies, latencies, reserve, fragmentation) are "
        "assumptions until calibrated (tools/gpu_check.sh)")


def depth_text(cfg: RunConfig) -> str:
    d = cfg.depth
    if d.kind == "fixed":
        return f"fixed({d.depth})"
    if d.kind == "pln":
        return f"PLN(mean {d.mean:g}, sigma {d.sigma:g}, cap {d.cap})"
    if d.kind == "poisson":
        return f"max(Poisson({d.mean:g}), 1), cap {d.cap}"
    return f"learned prior, initial law {d.init} (mean {d.mean:g}, r_max {d.r_max})"


def _g(x: float) -> str:
    return f"{x / GiB:.2f}"


def header(plan: Plan, config: str) -> str:
    L, c, cfg = plan.layout, plan.cluster, plan.cfg
    nodes = -(-L.world // c.gpus_per_node)
    return (f"megaloop plan: {config} on {L.world} x {c.gpu} ({nodes} node(s) x {c.gpus_per_node}), {NOTE}\n"
            f"layout: {L.short()}; {L.microbatches} microbatches per step and DP rank; vocab {plan.vocab}; "
            f"depth {depth_text(cfg)}, bptt_window {cfg.model.bptt_window}")


def format_memory(plan: Plan) -> str:
    c = plan.cluster
    lines = [f"memory per GPU, GiB (worst case: every in-flight microbatch at its stage's worst depth; "
             f"activations flat in R: only the TBPTT window backpropagates)",
             "  pp rank | params | grads | optimizer | activations (in flight) | transient | reserve+frag | total"]
    for r in plan.memory:
        lines.append(f"  {r['rank']:7d} | {_g(r['params']):>6} | {_g(r['grads']):>5} | {_g(r['optimizer']):>9} | "
                     f"{_g(r['activations']):>11} ({r['in_flight']}) | {_g(r['transient']):>9} | "
                     f"{_g(r['overhead']):>12} | {_g(r['total'])}   {r['stages']}")
    big = plan.largest
    for d in big.get("per_microbatch", []):
        lines.append(f"  largest rank, one microbatch on stage {d['stage']} at its worst depth {d['worst_depth']}: "
                     f"TBPTT window {_g(d['window'])}, prelude/coda {_g(d['prelude_coda'])}, logit buffer "
                     f"{_g(d['logits'])}, pipeline buffers {_g(d['pipeline'])}, other {_g(d['other'])}; "
                     f"forward working set {_g(d['no_grad_working_set'])} GiB")
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    lines.append(f"  largest: pp rank {big['rank']} [{big['stages']}]: {_g(big['total'])} of {c.gpu_memory_gib:.1f} GiB "
                 f"-> {verdict}")
    if plan.sampled_peak:
        sp = plan.sampled_peak
        lines.append(f"  over sampled steps: largest-rank peak {_g(sp['mean'])} GiB mean, {_g(sp['max'])} max")
    return "\n".join(lines)


def format_plan(plan: Plan, config: str) -> str:
    s, f = plan.steps, plan.fixed
    ms = 1e3
    n = plan.cfg.train
    lines = [header(plan, config), format_memory(plan),
             f"step ({int(s['step_s'].get('n', 0)) or 'sampled'} steps, depths from the run's sampler):",
             f"  step time {s['step_s']['mean'] * ms:.1f} ms (sd {s['step_s']['std'] * ms:.1f}, "
             f"{s['step_s']['min'] * ms:.1f}-{s['step_s']['max'] * ms:.1f}); "
             f"{s['tokens_per_s']:.3g} tokens/s ({n.global_batch_size} x {plan.cfg.model.seq_len} per step)",
             f"  MFU {100 * s['mfu']['mean']:.1f} % (sd {100 * s['mfu']['std']:.1f}) of dense bf16 peak "
             f"{plan.cluster.peak_bf16_tflops:g} TFLOP/s",
             f"  pipeline {s['pipeline_s']['mean'] * ms:.1f} ms | DP gradient reduce {s['dp_s'] * ms:.2f} ms | "
             f"core-replica sync {s['core_sync_s'] * ms:.2f} ms | optimizer {s['optimizer_s'] * ms:.2f} ms",
             f"  bubble {100 * s['bubble']['mean']:.1f} % (sd {100 * s['bubble']['std']:.1f}, "
             f"{100 * s['bubble']['min']:.1f}-{100 * s['bubble']['max']:.1f}; of it stage imbalance "
             f"{100 * s['imbalance']['mean']:.1f} %); fixed depth {f['depth']} (the mean): "
             f"{100 * f['bubble']['mean']:.1f} % (imbalance {100 * f['imbalance']['mean']:.1f} %), "
             f"MFU {100 * f['mfu']['mean']:.1f} %; "
             f"textbook (p-1)/(v*m+p-1) = {100 * textbook_bubble(plan.layout.pp, plan.layout.microbatches, plan.layout.vpp):.1f} %"]
    return "\n".join(lines)


def format_preflight(plan: Plan, config: str) -> str:
    big, c, L = plan.largest, plan.cluster, plan.layout
    what = (f"{config} at {L.short()} on {L.world} x {c.gpu}: largest rank pp {big['rank']} "
            f"[{big['stages']}] {_g(big['total'])} GiB of {c.gpu_memory_gib:.1f} GiB")
    if plan.fits:
        return f"megaloop preflight: ok: {what} (prediction)"
    return (f"megaloop preflight: refusing: predicted not to fit: {what}; try megaloop plan --search, "
            f"or launch with --no-preflight")


def format_search(plans: list[Plan], excluded: dict, cfg: RunConfig, cluster: ClusterSpec, world: int,
                  n_fit: int) -> str:
    lines = [f"megaloop plan --search: {world} x {cluster.gpu}; {n_fit} layouts fit, excluded: "
             f"{excluded['memory']} by memory, {excluded['config']} by the config's rules; {NOTE}",
             f"depth {depth_text(cfg)}; ranked by predicted tokens/s",
             "  # | layout | M | memory GiB (largest rank) | bubble % (sd) | fixed-depth bubble % | MFU % | step ms | tokens/s"]
    for i, p in enumerate(plans, 1):
        s = p.steps
        lines.append(f"  {i} | {p.layout.short()} | {p.layout.microbatches} | {_g(p.largest['total'])} | "
                     f"{100 * s['bubble']['mean']:.1f} ({100 * s['bubble']['std']:.1f}) | "
                     f"{100 * p.fixed['bubble']['mean']:.1f} | {100 * s['mfu']['mean']:.1f} | "
                     f"{1e3 * s['step_s']['mean']:.1f} | {s['tokens_per_s']:.3g}")
    if not plans:
        lines.append("  (no layout fits)")
    return "\n".join(lines)


def plan_json(plan: Plan) -> dict:
    L = plan.layout
    return {"layout": {k: getattr(L, k) for k in L.__dataclass_fields__}, "layout_text": L.short(),
            "cluster": plan.cluster.name, "gpu": plan.cluster.gpu, "gpu_memory_gib": plan.cluster.gpu_memory_gib,
            "vocab": plan.vocab, "mean_depth": plan.mean_depth, "fits": plan.fits,
            "memory_gib": [{k: (v / GiB if k not in ("rank", "in_flight", "stages", "param_count", "per_microbatch")
                                else v) for k, v in r.items()} for r in plan.memory],
            "largest_rank": plan.largest["rank"], "sampled_peak_gib": {k: v / GiB for k, v in plan.sampled_peak.items()},
            "steps": plan.steps, "fixed_depth": plan.fixed, "predictions": True}


def microbatch_sweep(cfg: RunConfig, layout: Layout, cluster: ClusterSpec, vocab: int, steps: int,
                     factors=(1, 2, 4, 8, 16)) -> list[dict]:
    """Bubble of the layout with sampled vs fixed (= mean) depth as microbatches per step grow."""
    from dataclasses import replace

    rows = []
    fixed_r = max(1, round(depth_mean(cfg)))
    for f in factors:
        m = layout.pp * f
        c = copy.deepcopy(cfg)
        c.train.global_batch_size = m * layout.micro_batch * layout.dp
        lay = replace(layout, microbatches=m)
        cost = CostModel(c, lay, cluster, vocab)
        sampled = [cost.step(p) for p in depth_plans(c, m, steps)]
        fixed = cost.step(fixed_depth_plans(fixed_r, m, 1)[0])
        rows.append({"microbatches": m, "bubble_sampled": summarize([e.bubble for e in sampled]),
                     "imbalance_sampled": summarize([e.sim.imbalance for e in sampled])["mean"],
                     "bubble_fixed": fixed.bubble, "imbalance_fixed": fixed.sim.imbalance,
                     "textbook": textbook_bubble(lay.pp, m, lay.vpp),
                     "mfu_sampled": summarize([cost.mfu(e) for e in sampled])["mean"], "mfu_fixed": cost.mfu(fixed),
                     "fixed_depth": fixed_r})
    return rows


def format_sweep(rows: list[dict]) -> str:
    lines = ["bubble vs microbatches per step (same layout; sampled depths vs fixed depth at the mean; "
             "in brackets the stage-imbalance part):",
             "  M | sampled bubble % (sd) [imbalance] | fixed bubble % [imbalance] | textbook % | MFU sampled / fixed %"]
    for r in rows:
        b = r["bubble_sampled"]
        lines.append(f"  {r['microbatches']} | {100 * b['mean']:.1f} ({100 * b['std']:.1f}) [{100 * r['imbalance_sampled']:.1f}] | "
                     f"{100 * r['bubble_fixed']:.1f} [{100 * r['imbalance_fixed']:.1f}] | "
                     f"{100 * r['textbook']:.1f} | {100 * r['mfu_sampled']:.1f} / {100 * r['mfu_fixed']:.1f}")
    return "\n".join(lines)
