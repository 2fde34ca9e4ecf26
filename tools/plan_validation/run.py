"""Validate the planner (megaloop/plan) against real CPU training runs over gloo.

    python tools/plan_validation/run.py [--only NAME ...] [--keep DIR [--reuse]]

Memory: each run's per-rank peak of allocated tensor bytes in a training step (worker.py --mode
memory: live tensors at the step's start + the process heap's rise during the step, from malloc
statistics sampled after every op, so frees on gloo's threads count) against ``MemoryModel`` with
the ``local`` activation profile (no GPU reserve or fragmentation; ``optimizer_temp_bytes=4``:
torch's foreach Adam allocates sqrt(v) per parameter), fed the depths each step actually drew.

Timing: each run's measured bubble (1 - sum of per-rank F/B compute time / (pp x makespan), steps
after the first) against ``pipeline_sim`` fed
  (a) the measured duration of every op and the measured latency of every p2p message on each side
      (checks the schedule model: megatron's op order, chunk mapping, blocking p2p);
  (a') the measured op durations with one typical message latency (the median; what is left of (a)
      once a stage no longer waits for a CPU core after its data arrived, on this shared machine);
  (b) op durations from the planner's cost model (FLOPs per layer visit and head plus memory-bound
      bytes; a CPU rate for forward FLOPs, one for backward FLOPs, a memory bandwidth and a per-op
      overhead fitted per layout to its fixed- and sampled-depth runs' ops by least squares), with the
      typical latency: checks "cost proportional to the stage's recurrences".
Timing runs use nice -10 (root only) so that other work on the shared machine takes less of their
time. Writes tools/plan_validation/results.json and results.md (the error table). Runs are tiny
(d=128, s=128) and take ~15-60 s each on 2 cores (OMP_NUM_THREADS=1 per rank).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

DATA = dict(num_sequences=1024, seq_len=128, vocab_size=4096)
BASE = ["train.log_interval=1", "logging.progress=false", "logging.wandb=disabled", "train.save_interval=0"]
PLN5 = ["depth.kind=pln", "depth.mean=5.0", "depth.sigma=0.5", "depth.cap=64"]

# name -> (mode, processes, overrides); all on the tiny preset (d=128, 4 heads, 1/2/1 layers, bptt_window 4)
RUNS = {
    "mem_tp1": ("memory", 1, ["depth.kind=fixed", "depth.depth=4", "train.global_batch_size=8",
                              "train.micro_batch_size=4"]),
    "mem_tp2": ("memory", 2, ["parallel.tp=2", "depth.kind=fixed", "depth.depth=4", "train.global_batch_size=8",
                              "train.micro_batch_size=4"]),
    "mem_recompute": ("memory", 1, ["model.recompute=true", "depth.kind=fixed", "depth.depth=6",
                                    "train.global_batch_size=8", "train.micro_batch_size=4"]),
    "mem_dp2_bf16_distopt": ("memory", 2, ["model.bf16=true", "parallel.distributed_optimizer=true",
                                           "depth.kind=fixed", "depth.depth=4", "train.global_batch_size=8",
                                           "train.micro_batch_size=2"]),
    "mem_pp2_pln": ("memory", 2, ["parallel.pp=2", *PLN5, "train.global_batch_size=16",
                                  "train.micro_batch_size=4"]),
    "mem_pp4_vpp2": ("memory", 4, ["parallel.pp=4", "parallel.vpp=2", "depth.kind=fixed", "depth.depth=8",
                                   "train.global_batch_size=16", "train.micro_batch_size=2"]),
    "mem_tp2sp_pp2": ("memory", 4, ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.pp=2",
                                    "depth.kind=fixed", "depth.depth=5", "train.global_batch_size=16",
                                    "train.micro_batch_size=4"]),
    "time_pp2_fixed": ("timing", 2, ["parallel.pp=2", "depth.kind=fixed", "depth.depth=5",
                                     "train.global_batch_size=64", "train.micro_batch_size=8"]),
    "time_pp2_pln": ("timing", 2, ["parallel.pp=2", *PLN5, "train.global_batch_size=64", "train.micro_batch_size=8"]),
    "time_pp4_vpp2_fixed": ("timing", 4, ["parallel.pp=4", "parallel.vpp=2", "depth.kind=fixed", "depth.depth=5",
                                          "train.global_batch_size=64", "train.micro_batch_size=8"]),
    "time_pp4_vpp2_pln": ("timing", 4, ["parallel.pp=4", "parallel.vpp=2", *PLN5, "train.global_batch_size=64",
                                        "train.micro_batch_size=8"]),
}
STEPS = {"memory": 3, "timing": 5}
NICE = -10  # timing runs' priority (root only); the machine this ran on is shared
LOAD: dict[str, float] = {}  # 1-minute load average around each run (the machine is shared)


def cpu_cluster():
    from megaloop.plan.cluster import ClusterSpec

    return ClusterSpec(name="cpu-gloo", gpu="cpu", activation_profile="local", reserved_gib=0.0,
                       fragmentation=1.0, optimizer_temp_bytes=4.0)


def launch(name: str, mode: str, nproc: int, overrides: list[str], data: Path, work: Path) -> list[dict]:
    out = work / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [str(torchrun), "--standalone", "--nproc_per_node", str(nproc), str(HERE / "worker.py"), "--mode", mode,
           "--out", str(out), "--steps", str(STEPS[mode]), "--", f"data.path={data}", *BASE, *overrides]
    if mode == "timing" and NICE and os.geteuid() == 0:  # less time lost to other work on a shared machine
        cmd = ["nice", "-n", str(NICE), *cmd]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", WANDB_MODE="disabled")
    t0 = time.time()
    LOAD[name] = os.getloadavg()[0]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    LOAD[name] = max(LOAD[name], os.getloadavg()[0])
    if proc.returncode:
        raise RuntimeError(f"{name}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    print(f"  {name}: {nproc} proc(s), {time.time() - t0:.0f} s", flush=True)
    return [json.loads(Path(f).read_text()) for f in sorted(glob.glob(str(out / "rank*.json")))]


def _setup(ranks: list[dict]):
    from megaloop.config import load_config
    from megaloop.plan.layout import make_layout

    cfg = load_config("tiny", ranks[0]["overrides"])
    return cfg, make_layout(cfg, len(ranks))


def evaluate_memory(ranks: list[dict]) -> dict:
    from megaloop.plan.memory import MemoryModel

    cfg, layout = _setup(ranks)
    mm = MemoryModel(cfg, layout, cpu_cluster(), ranks[0]["vocab"])
    rows = []
    for r in ranks:
        k = r["pp_rank"]
        st = mm.static(k)
        marks = sorted(m for m in r["heap"] if m.startswith("step"))
        static = r["heap"][marks[1]]["tensors_at_start"]  # after step 0, which allocates the optimizer state
        for i, mark in enumerate(marks[1:], start=1):
            h = r["heap"][mark]
            meas = {"peak": h["tensors_at_start"] + h["peak"] - h["level_at_start"]}
            tot = mm.rank_total(k, mm.rank_peak(k, r["steps"][i]["depths"]))
            rows.append({"rank": r["rank"], "pp_rank": k, "step": i, "measured_peak": meas["peak"],
                         "predicted_peak": tot["total"], "measured_static": static,
                         "predicted_static": st["params"] + st["grads"] + st["optimizer"],
                         "measured_dynamic": h["peak"] - h["level_at_start"],
                         "other_heap": h["level_at_start"] - r["heap"]["baseline"] - h["tensors_at_start"],
                         "predicted_dynamic": tot["dynamic"], "depths": r["steps"][i]["depths"]})
    worst = max(rows, key=lambda x: abs(x["predicted_peak"] / x["measured_peak"] - 1))
    return {"layout": layout.short(), "rows": rows,
            "max_abs_err_peak": abs(worst["predicted_peak"] / worst["measured_peak"] - 1),
            "worst": {k: worst[k] for k in ("rank", "step", "measured_peak", "predicted_peak")},
            "max_abs_err_static": max(abs(x["predicted_static"] / x["measured_static"] - 1) for x in rows),
            "max_abs_err_dynamic": max(abs(x["predicted_dynamic"] / x["measured_dynamic"] - 1) for x in rows)}


def _terms(cost, kind: str, v: int, r: int) -> list[float]:
    """The cost model's regressors of an op: forward FLOPs, backward FLOPs, memory-bound bytes, 1."""
    f = sum(cost.flops(kind, v, r))
    return [f * (kind == "F"), f * (kind == "B"), cost.mem_bytes(kind, v, r), 1.0]


def _fit_rate(cost, ops: list[tuple[str, int, int, float]]):
    """Least squares ``duration = flops_F x a + flops_B x b + bytes x c + overhead`` over the run's ops
    (kind, virtual stage, depth, seconds): the planner's cost terms with CPU constants (a CPU's
    backward is not 2x its forward; its memory-bound work is no small share)."""
    import numpy as np

    a = np.array([_terms(cost, k, v, r) for k, v, r, _ in ops])
    y = np.array([dt for *_, dt in ops])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    return [max(float(c), 0.0) for c in coef]


def timing_ops(ranks: list[dict]) -> list[tuple[str, int, int, float]]:
    """(kind, virtual stage, depth, seconds) of every op after the first step, pipeline ranks of DP 0."""
    by_pp = {r["pp_rank"]: r for r in ranks if r["dp_rank"] == 0 and r["tp_rank"] == 0}
    pp = len(by_pp)
    out = []
    for i in range(1, len(by_pp[0]["steps"])):
        depths = by_pp[0]["steps"][i]["depths"]
        for k, r in by_pp.items():
            out += [(kind, c * pp + k, depths[mb], t1 - t0) for kind, mb, c, t0, t1 in r["steps"][i]["ops"]]
    return out


def _latencies(by_pp: dict[int, dict]) -> list[dict[tuple, list[tuple[float, float]]]]:
    """Per step, the measured latency of every p2p message, by ring link (direction, src, dst) in
    order: the n-th send on a link matches the n-th receive (megatron's order); seen by the sender
    and by the receiver, from the moment both sides posted it to the end of that side's p2p call
    (on a shared CPU a side may wait long after the data is there, for a core to run on)."""
    pp = len(by_pp)
    starts = [st["start"] for st in by_pp[0]["steps"]] + [float("inf")]
    out = []
    for i in range(len(starts) - 1):
        lo, hi = min(r["steps"][i]["start"] for r in by_pp.values()) - 1e-3, starts[i + 1]
        sends: dict[tuple, list] = {}
        recvs: dict[tuple, list] = {}
        for k, r in by_pp.items():
            for what, t0, t1 in r.get("comm", []):
                if not lo <= t0 < hi:
                    continue
                for flag, d, peer, box in (("s", "f", (k + 1) % pp, sends), ("S", "b", (k - 1) % pp, sends),
                                           ("r", "f", (k - 1) % pp, recvs), ("R", "b", (k + 1) % pp, recvs)):
                    if flag in what:
                        link = (d, k, peer) if box is sends else (d, peer, k)
                        box.setdefault(link, []).append((t0, t1))
        out.append({link: [(max(0.0, e1 - max(s1, s2)), max(0.0, e2 - max(s1, s2)))
                           for (s1, e1), (s2, e2) in zip(ss, recvs.get(link, []))] for link, ss in sends.items()})
    return out


def evaluate_timing(ranks: list[dict], pooled_ops: list | None = None) -> dict:
    from megaloop.plan.cost import CostModel
    from megaloop.plan.pipeline_sim import simulate

    cfg, layout = _setup(ranks)
    pp = layout.pp
    by_pp = {r["pp_rank"]: r for r in ranks if r["dp_rank"] == 0 and r["tp_rank"] == 0}
    ping = next(r["p2p_s"] for r in ranks if r.get("p2p_s") is not None)
    lat = _latencies(by_pp)
    every = [min(x) for step in lat[1:] for v in step.values() for x in v]
    p2p = statistics.median(every) if every else ping
    cost = CostModel(cfg, layout, cpu_cluster(), ranks[0]["vocab"])
    n_steps = len(by_pp[0]["steps"])
    fit = _fit_rate(cost, pooled_ops or timing_ops(ranks))
    rows = []
    for i in range(1, n_steps):
        depths = by_pp[0]["steps"][i]["depths"]
        start = min(r["steps"][i]["start"] for r in by_pp.values())
        end = max(max(op[4] for op in r["steps"][i]["ops"]) for r in by_pp.values())
        busy = [sum(op[4] - op[3] for op in by_pp[k]["steps"][i]["ops"]) for k in range(pp)]
        measured = 1 - sum(busy) / (pp * (end - start))
        dur = {(op[0], op[1], op[2] * pp + k): op[4] - op[3] for k in range(pp) for op in by_pp[k]["steps"][i]["ops"]}
        step_lat = lat[i]
        def measured_latency(d, a, b, n, is_send, step_lat=step_lat):
            got = step_lat.get((d, a, b), [])
            return got[n][0 if is_send else 1] if n < len(got) else p2p

        replay = simulate(pp, len(depths), lambda kind, mb, v: dur[(kind, mb, v)], vpp=layout.vpp, per_message=True,
                          transfer=measured_latency)
        typical = simulate(pp, len(depths), lambda kind, mb, v: dur[(kind, mb, v)], vpp=layout.vpp, transfer=p2p)
        model = simulate(pp, len(depths),
                         lambda kind, mb, v: sum(c * x for c, x in zip(fit, _terms(cost, kind, v, depths[mb]))),
                         vpp=layout.vpp, transfer=p2p)
        rows.append({"step": i, "depths": depths, "measured_bubble": measured, "sim_measured_ops": replay.bubble,
                     "sim_measured_ops_typical_latency": typical.bubble, "sim_cost_model": model.bubble, "measured_makespan_s": end - start,
                     "sim_measured_ops_makespan_s": replay.makespan, "sim_cost_model_makespan_s": model.makespan})
    keys = ("measured_bubble", "sim_measured_ops", "sim_measured_ops_typical_latency", "sim_cost_model")
    mean = {k: statistics.fmean(x[k] for x in rows) for k in keys}
    err_mean = {k: 100 * abs(mean[k] - mean["measured_bubble"]) for k in keys[1:]}
    # the cost model against the same ops without the waits for a core (typical message latency)
    err_mean["cost_model_vs_typical_latency"] = 100 * abs(mean["sim_cost_model"] - mean["sim_measured_ops_typical_latency"])
    return {"layout": layout.short(), "p2p_s": p2p, "p2p_pingpong_s": ping,
            "fitted": {"fwd_gflops": 1e-9 / fit[0] if fit[0] else None, "bwd_gflops": 1e-9 / fit[1] if fit[1] else None,
                       "mem_gbps": 1e-9 / fit[2] if fit[2] else None, "op_overhead_s": fit[3]},
            "rows": rows, "mean": mean, "err_points_of_mean": err_mean,
            "max_abs_err_points_measured_ops": 100 * max(abs(x["sim_measured_ops"] - x["measured_bubble"]) for x in rows),
            "max_abs_err_points_cost_model": 100 * max(abs(x["sim_cost_model"] - x["measured_bubble"]) for x in rows)}


def markdown(results: dict) -> str:
    lines = ["# Planner validation: predicted vs measured on CPU (gloo)", "",
             "Generated by `python tools/plan_validation/run.py` (see its docstring for what is measured) on "
             "2 shared CPU cores, one gloo process per rank, OMP_NUM_THREADS=1; the tiny preset (d=128, 4 heads, "
             "1/2/1 layers, s=128, bptt_window 4, vocab 4,096, fp32 unless noted), synthetic data.", "",
             "## Memory per rank (peak of allocated tensor bytes inside a training step)", "",
             "| run | layout | depths (last step) | measured peak MiB (worst rank) | predicted MiB | max error, peak | "
             "max error, static | max error, dynamic |", "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        if r.get("mode") != "memory":
            continue
        w = r["worst"]
        depths = r["rows"][-1]["depths"]
        lines.append(f"| {name} | {r['layout']} | {depths} | {w['measured_peak'] / 2**20:.1f} | "
                     f"{w['predicted_peak'] / 2**20:.1f} | {100 * r['max_abs_err_peak']:.1f} % | "
                     f"{100 * r['max_abs_err_static']:.1f} % | {100 * r['max_abs_err_dynamic']:.1f} % |")
    lines += ["", "## Pipeline bubble (steps after the first)", "",
              "| run | layout | depths | measured bubble, mean (sd) of steps | (a) simulated: measured op times "
              "and message latencies | error (points), mean / worst step | (a') measured op times, typical "
              "latency | (b) simulated: cost model | (b) - (a') (points) | (b) - measured (points) | "
              "typical latency ms | load avg |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        if r.get("mode") != "timing":
            continue
        m, e = r["mean"], r["err_points_of_mean"]
        depths = "fixed 5" if "depth.kind=fixed" in r["overrides"] else "PLN-5 (cap 64)"
        sd = statistics.pstdev(x["measured_bubble"] for x in r["rows"])
        lines.append(f"| {name} | {r['layout']} | {depths} | {m['measured_bubble']:.3f} ({sd:.3f}) | "
                     f"{m['sim_measured_ops']:.3f} | {e['sim_measured_ops']:.1f} / "
                     f"{r['max_abs_err_points_measured_ops']:.1f} | {m['sim_measured_ops_typical_latency']:.3f} | "
                     f"{m['sim_cost_model']:.3f} | {100 * (m['sim_cost_model'] - m['sim_measured_ops_typical_latency']):+.1f} | "
                     f"{100 * (m['sim_cost_model'] - m['measured_bubble']):+.1f} | "
                     f"{1e3 * r['p2p_s']:.2f} | {r.get('load_avg', float('nan')):.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--only", nargs="*", help="run only these (results of the others are kept)")
    p.add_argument("--keep", default=None, help="work directory to keep (default: a temporary one)")
    p.add_argument("--results", default=str(HERE / "results.json"))
    p.add_argument("--reuse", action="store_true", help="re-evaluate the rank files already in --keep DIR")
    args = p.parse_args()
    if args.only is not None and (not args.only or set(args.only) - set(RUNS)):  # before any data is written
        p.error(f"--only: give one or more of {', '.join(RUNS)}" +
                (f" (unknown: {', '.join(sorted(set(args.only) - set(RUNS)))})" if args.only else ""))
    path = Path(args.results)
    try:
        results = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError) as err:
        p.error(f"--results {path}: cannot be read as JSON ({getattr(err, 'strerror', None) or err})")
    work = Path(args.keep or tempfile.mkdtemp(prefix="plan_validation_"))
    data = work / "data"
    from megaloop.data.synthetic import write_synthetic_mds

    write_synthetic_mds(data, **DATA)
    names = args.only or list(RUNS)
    timing_ranks: dict[str, list[dict]] = {}
    for name in names:
        mode, nproc, ov = RUNS[name]
        files = sorted(glob.glob(str(work / name / "rank*.json")))
        if args.reuse and len(files) == nproc:
            ranks = [json.loads(Path(f).read_text()) for f in files]
        else:
            ranks = launch(name, mode, nproc, ov, data, work)
        if mode == "timing":
            timing_ranks[name] = ranks
            continue
        res = evaluate_memory(ranks)
        res.update(mode=mode, processes=nproc, overrides=ov, date=time.strftime("%Y-%m-%d"))
        results[name] = res
        path.write_text(json.dumps(results, indent=1))
        print(f"    {res['layout']}: max_abs_err_peak = {res['max_abs_err_peak']:.3f}", flush=True)
    # the cost model's CPU constants are fitted per layout on its fixed- and sampled-depth runs together
    # (runs not launched this time count with their rank files in the work directory)
    groups: dict[str, list] = {}
    pool = dict(timing_ranks)
    for name, (mode, nproc, _ov) in RUNS.items():
        files = sorted(glob.glob(str(work / name / "rank*.json")))
        if mode == "timing" and name not in pool and len(files) == nproc:
            pool[name] = [json.loads(Path(f).read_text()) for f in files]
    for name, ranks in pool.items():
        groups.setdefault(RUNS[name][0] + str(ranks[0]["pp"]) + str(ranks[0]["vpp"]), []).extend(timing_ops(ranks))
    for name, ranks in timing_ranks.items():
        mode, nproc, ov = RUNS[name]
        res = evaluate_timing(ranks, groups[mode + str(ranks[0]["pp"]) + str(ranks[0]["vpp"])])
        res.update(mode=mode, processes=nproc, overrides=ov, date=time.strftime("%Y-%m-%d"),
                   load_avg=LOAD.get(name, results.get(name, {}).get("load_avg", os.getloadavg()[0])))
        results[name] = res
        path.write_text(json.dumps(results, indent=1))
        print(f"    {res['layout']}: bubble error of the mean, points {res['err_points_of_mean']}", flush=True)
    import platform

    import torch

    results["_machine"] = {"cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
                           "platform": platform.platform(), "note": "shared with other work; see load_avg per run"}
    path.write_text(json.dumps(results, indent=1))
    (path.with_suffix(".md")).write_text(markdown({k: results[k] for k in RUNS if k in results}))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    print(markdown({k: results[k] for k in RUNS if k in results}))


if __name__ == "__main__":
    main()
