"""Text and JSON renderings of planner results (GiB, ms, percent).

JSON units: keys ending in ``_gib`` hold GiB (every byte count under them, the per-microbatch
breakdown included; counts such as ``n``, ``rank``, ``in_flight``, ``param_count``, ``stage`` and
``worst_depth`` stay counts), ``_s`` seconds, ``mfu`` / ``bubble`` fractions, ``tokens_per_s``
tokens per second.
"""

from __future__ import annotations

import copy

from megaloop.config import RunConfig
from megaloop.plan.cluster import ClusterSpec
from megaloop.plan.cost import CostModel, summarize
from megaloop.plan.layout import Layout, depth_law, depth_mean, depth_plans, fixed_depth_plans
from megaloop.plan.memory import GiB
from megaloop.plan.pipeline_sim import textbook_bubble
from megaloop.plan.search import Plan, expected_step, ties

NOTE = ("predictions: GPU constants of the cost model (efficiencies, latencies, reserve, fragmentation) are "
        "assumptions until calibrated (tools/gpu_check.sh)")
# keys of a memory row / summary that are counts or labels, not bytes
COUNTS = frozenset({"rank", "in_flight", "stages", "param_count", "per_microbatch", "stage", "worst_depth", "n"})


def depth_text(cfg: RunConfig) -> str:
    d = cfg.depth
    if d.kind == "fixed":
        return f"fixed({d.depth})"
    if d.kind == "pln":
        return f"PLN(mean {d.mean:g}, sigma {d.sigma:g}, cap {d.cap})"
    if d.kind == "poisson":
        return f"max(Poisson({d.mean:g}), 1), cap {d.cap}"
    return f"learned prior, initial law {d.init} (mean {depth_mean(cfg):.4g}, r_max {d.r_max})"


def _g(x: float) -> str:
    return f"{x / GiB:.2f}"


def _gib(d: dict) -> dict:
    """Byte values of ``d`` in GiB (counts and labels kept; nested lists of dicts too)."""
    out = {}
    for k, v in d.items():
        if k in COUNTS and k != "per_microbatch":
            out[k] = v
        elif isinstance(v, list):
            out[k] = [_gib(x) if isinstance(x, dict) else x for x in v]
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = v / GiB
        else:
            out[k] = v
    return out


def vocab_text(vocab: int, source: str) -> str:
    return f"vocab {vocab}" + (f" ({source})" if source else "")


def cluster_note(c: ClusterSpec) -> str:
    """The fields a cluster description left out (they took the shipped defaults), or ''."""
    return f"cluster {c.name}: not in the description, defaults used for {', '.join(c.defaulted)}" if c.defaulted else ""


def header(plan: Plan, config: str) -> str:
    L, c, cfg = plan.layout, plan.cluster, plan.cfg
    nodes = -(-L.world // c.gpus_per_node)
    lines = [f"megaloop plan: {config} on {L.world} x {c.gpu} ({nodes} node(s) x {c.gpus_per_node}), {NOTE}",
             f"layout: {L.short()}; {L.microbatches} microbatches per step and DP rank; "
             f"{vocab_text(plan.vocab, plan.vocab_source)}; depth {depth_text(cfg)}, bptt_window {cfg.model.bptt_window}"]
    if cluster_note(c):
        lines.append(cluster_note(c))
    return "\n".join(lines)


def format_memory(plan: Plan) -> str:
    c = plan.cluster
    lines = ["memory per GPU, GiB (worst case: every in-flight microbatch at its stage's worst depth; "
             "activations flat in R: only the TBPTT window backpropagates)",
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


def _peak_text(s: dict) -> str:
    """'dense bf16 peak 989 TFLOP/s' (FP8 layouts: the FP8 peak, and the bf16 figure the trainer logs)."""
    e = s["expected"]
    if s["peak_precision"] == "fp8":
        return (f"dense FP8 peak {s['peak_tflops']:g} TFLOP/s (FP8 layout; against the bf16 peak, as the trainer's "
                f"logged mfu: {100 * e['mfu_vs_bf16']:.1f} %)")
    return f"dense bf16 peak {s['peak_tflops']:g} TFLOP/s"


def _se_text(e: dict) -> str:
    se = e["tokens_per_s_se"]
    if se is None:
        return "(noise not estimated from 1 sampled step)"
    if not se:
        return "(exact: no pipeline stretch to sample)"
    return f"± {100 * 2 * se / e['tokens_per_s']:.1f} % (2 standard errors of the sampled pipeline stretch)"


def format_plan(plan: Plan, config: str) -> str:
    s, f = plan.steps, plan.fixed
    e = s["expected"]
    ms = 1e3
    n = plan.cfg.train
    lines = [header(plan, config), format_memory(plan),
             f"step ({int(s['step_s'].get('n', 0)) or 'sampled'} steps, depths from the run's sampler):",
             f"  step time {s['step_s']['mean'] * ms:.1f} ms (sd {s['step_s']['std'] * ms:.1f}, "
             f"{s['step_s']['min'] * ms:.1f}-{s['step_s']['max'] * ms:.1f}); expected over the depth law "
             f"{e['step_s'] * ms:.1f} ms: {e['tokens_per_s']:.3g} tokens/s {_se_text(e)}; "
             f"{n.global_batch_size} x {plan.cfg.model.seq_len} tokens per step",
             f"  MFU {100 * e['mfu']:.1f} % expected (sd {100 * s['mfu']['std']:.1f} over the steps) of {_peak_text(s)}",
             f"  pipeline {s['pipeline_s']['mean'] * ms:.1f} ms | DP gradient reduce {s['dp_s'] * ms:.2f} ms | "
             f"core-replica sync {s['core_sync_s'] * ms:.2f} ms | optimizer {s['optimizer_s'] * ms:.2f} ms",
             f"  bubble {100 * s['bubble']['mean']:.1f} % (sd {100 * s['bubble']['std']:.1f}, "
             f"{100 * s['bubble']['min']:.1f}-{100 * s['bubble']['max']:.1f}; of it stage imbalance "
             f"{100 * s['imbalance']['mean']:.1f} %); fixed depth {f['depth']} (the mean): "
             f"{100 * f['bubble']['mean']:.1f} % (imbalance {100 * f['imbalance']['mean']:.1f} %), "
             f"MFU {100 * f['expected']['mfu']:.1f} %; "
             f"textbook (p-1)/(v*m+p-1) = {100 * textbook_bubble(plan.layout.pp, plan.layout.microbatches, plan.layout.vpp):.1f} %"]
    return "\n".join(lines)


def format_preflight(plan: Plan, config: str) -> str:
    big, c, L = plan.largest, plan.cluster, plan.layout
    what = (f"{config} at {L.short()} on {L.world} x {c.gpu}: largest rank pp {big['rank']} "
            f"[{big['stages']}] {_g(big['total'])} GiB of {c.gpu_memory_gib:.1f} GiB at "
            f"{vocab_text(plan.vocab, plan.vocab_source)}")
    if plan.fits:
        return f"megaloop preflight: ok: {what} (prediction)"
    return (f"megaloop preflight: refusing: predicted not to fit: {what}; try megaloop plan --search, "
            f"or launch with --no-preflight")


def _layout_json(plan: Plan) -> dict:
    """The layout and cluster keys :func:`plan_json` and :func:`preflight_json` share."""
    L, c = plan.layout, plan.cluster
    return {"layout": {k: getattr(L, k) for k in L.__dataclass_fields__}, "layout_text": L.short(),
            "cluster": c.name, "gpu": c.gpu, "gpu_memory_gib": c.gpu_memory_gib}


def preflight_json(plan: Plan, config: str, line: str) -> dict:
    big = plan.largest
    return {"preflight": "ok" if plan.fits else "refusing", "fits": plan.fits, "config": config,
            **_layout_json(plan), "largest_rank": big["rank"], "largest_stages": big["stages"],
            "largest_total_gib": big["total"] / GiB, "vocab": plan.vocab, "vocab_source": plan.vocab_source,
            "line": line, "predictions": True}


def _held_text(held: dict) -> str:
    flags = []
    for k, v in held.items():
        if isinstance(v, bool):
            flags.append(f"--{k}" if v else f"--no-{k}")
        else:
            flags.append(f"--{k} {v}")
    return " ".join(flags)


def format_search(plans: list[Plan], excluded: dict, cfg: RunConfig, cluster: ClusterSpec, world: int,
                  held: dict, steps: int, vocab: int, vocab_source: str) -> str:
    n_fit = excluded["fitting"]
    lines = [f"megaloop plan --search: {world} x {cluster.gpu}; {n_fit} layouts fit, excluded: "
             f"{excluded['memory']} by memory, {excluded['config']} by the config's rules"
             + (f" ({_rules_text(excluded['rules'])})" if excluded["rules"] else "") + f"; {NOTE}",
             f"depth {depth_text(cfg)}; {vocab_text(vocab, vocab_source)}"
             + (f"; held fixed: {_held_text(held)}" if held else ""),
             f"ranked by expected tokens/s over the depth law (MFU ranks alike: same model FLOPs per step, "
             f"{'FP8' if cfg.model.fp8 else 'bf16'} peak); {excluded.get('simulated', len(plans))} of {n_fit} "
             f"simulated over {steps} sampled steps"
             + (f" (the others' expected tokens/s is bounded below row {len(plans)}'s)"
                if excluded.get("simulated", n_fit) < n_fit else "")]
    if cluster_note(cluster):
        lines.append(cluster_note(cluster))
    lines.append("  # | layout | M | memory GiB (largest rank) | bubble % (sd) | fixed-depth bubble % | MFU % | "
                 "step ms | tokens/s (± 2 se)")
    for i, p in enumerate(plans, 1):
        s, e = p.steps, p.steps["expected"]
        se = e["tokens_per_s_se"]
        noise = "± n/a" if se is None else (f"± {100 * 2 * se / e['tokens_per_s']:.1f} %" if se else "exact")
        lines.append(f"  {i} | {p.layout.short()} | {p.layout.microbatches} | {_g(p.largest['total'])} | "
                     f"{100 * s['bubble']['mean']:.1f} ({100 * s['bubble']['std']:.1f}) | "
                     f"{100 * p.fixed['bubble']['mean']:.1f} | {100 * e['mfu']:.1f} | "
                     f"{1e3 * e['step_s']:.1f} | {e['tokens_per_s']:.4g} ({noise})")
    runs = ties(plans)
    if runs:
        rows = ", ".join(f"{a}-{b}" for a, b in runs)
        lines.append(f"  rows {rows}: within the simulation's noise of each other (2 standard errors over {steps} "
                     f"sampled steps): their order is not a prediction; more --steps narrows it")
    return "\n".join(lines)


def _rules_text(rules: dict, examples: dict | None = None) -> str:
    """Candidates excluded per config rule, most first (with ``examples``: one message of each)."""
    counts = sorted(rules.items(), key=lambda kv: -kv[1])
    if examples is None:
        return ", ".join(f"{k}: {v}" for k, v in counts)
    return "; ".join(f"{k}: {v} (e.g. {examples[k]})" for k, v in counts)


def search_failure(excluded: dict, cluster: ClusterSpec, world: int, held: dict, min_pp: int) -> str:
    """The one line ``--search`` exits 2 with when no layout fits: what excluded the candidates
    (count per config rule, with one of its messages; how many by memory, and the closest)."""
    n = excluded["config"] + excluded["memory"]
    parts = []
    if excluded["config"]:
        rules = _rules_text(excluded["rules"], excluded["examples"])
        parts.append(f"{excluded['config']} by the config's rules [{rules}]")
    if excluded["memory"]:
        parts.append(f"{excluded['memory']} predicted not to fit in {cluster.gpu_memory_gib:g} GiB (the smallest "
                     f"largest rank: {excluded['least_memory_gib']:.2f} GiB)")
    where = f"{world} x {cluster.gpu}"
    if held:
        where += f", held fixed: {_held_text(held)}"
    if min_pp > 1:
        where += f", --min-pp {min_pp}"
    return f"--search: no layout fits ({where}): of {n} candidates, " + ("; ".join(parts) or "none was tried")


def plan_json(plan: Plan) -> dict:
    return {**_layout_json(plan), "cluster_defaults_used": list(plan.cluster.defaulted),
            "vocab": plan.vocab, "vocab_source": plan.vocab_source, "mean_depth": plan.mean_depth, "fits": plan.fits,
            "memory_gib": [_gib(r) for r in plan.memory],
            "largest_rank": plan.largest["rank"], "sampled_peak_gib": _gib(plan.sampled_peak),
            "steps": plan.steps, "fixed_depth": plan.fixed, "predictions": True}


def microbatch_sweep(cfg: RunConfig, layout: Layout, cluster: ClusterSpec, vocab: int, steps: int,
                     factors=(1, 2, 4, 8, 16)) -> list[dict]:
    """Bubble of the layout with sampled vs fixed (= mean) depth as microbatches per step grow;
    MFU as :func:`~megaloop.plan.search.expected_step` estimates it (expected over the depth law)."""
    from dataclasses import replace

    rows = []
    fixed_r = max(1, round(depth_mean(cfg)))
    law = depth_law(cfg)
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
                     "mfu_sampled": expected_step(cost, sampled, law)["mfu"],
                     "mfu_fixed": expected_step(cost, [fixed], [(fixed_r, 1.0)])["mfu"],
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
