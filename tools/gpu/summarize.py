"""Last step of tools/gpu_check.sh: collect the step outputs in OUT into OUT/summary.json.

    python tools/gpu/summarize.py OUT --mode gpu|cpu_smoke --warmup 5 [--runs bf16 fp8]

Reads OUT/steps.tsv (name, exit code, seconds per step), OUT/device.json (tools/gpu/probe.py),
OUT/logits.json (tools/gpu/logits_check.py), OUT/train_<run>/metrics.jsonl (one JSON object per
optimizer step, written by the trainer with train.log_interval=1) and OUT/loop_overhead*.json
(tools/bench/bench_loop_overhead.py with MEGALOOP_BENCH_RESULTS=OUT), and OUT/plan_calibration.json
if present (tools/gpu/plan_calibration.py; recorded, not checked). Each training run gets the
median of every metric in METRICS over its steps after the first ``--warmup``. Prints a short
report, writes summary.json, and exits 1 (listing the problems) when a step failed, an expected
part is missing, a median is not finite, or the GPU FP32 logits disagree with the CPU reference.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

METRICS = ("tokens_per_s", "tflops", "mfu", "step_time_s", "peak_mem_gib")
# Reported only on a CUDA device (torch.cuda.max_memory_allocated); null in the CPU smoke mode.
CUDA_ONLY = ("peak_mem_gib",)


def _read_json(path: Path, problems: list[str]):
    if not path.is_file():
        problems.append(f"{path.name} is missing")
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        problems.append(f"{path.name} is not valid JSON ({err})")
        return None


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def summarize_run(run_dir: Path, warmup: int, cuda: bool, problems: list[str]) -> dict:
    name = run_dir.name
    rows = []
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        for i, line in enumerate(metrics.read_text().splitlines()):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                problems.append(f"{name}/metrics.jsonl line {i + 1} is not JSON")
    else:
        problems.append(f"{name}/metrics.jsonl is missing")
    steps = [r for r in rows if isinstance(r.get("step"), int)]
    timed = steps[warmup:] if len(steps) > warmup else []
    if not timed:
        problems.append(f"{name}: {len(steps)} logged steps, none after the {warmup} warm-up steps")
    median = {}
    for key in METRICS:
        vals = [r[key] for r in timed if _finite(r.get(key))]
        median[key] = statistics.median(vals) if vals else None
        if median[key] is None and timed and (cuda or key not in CUDA_ONLY):
            problems.append(f"{name}: no finite {key} in the timed steps")
    last = steps[-1] if steps else {}
    out = {"steps_logged": len(steps), "steps_in_median": len(timed),
           "median_step_range": [timed[0]["step"], timed[-1]["step"]] if timed else None,
           "median": median, "final_loss": last.get("loss"), "val_ce": last.get("val_ce"),
           "mean_depth": statistics.mean(r["mean_depth"] for r in timed if _finite(r.get("mean_depth")))
           if any(_finite(r.get("mean_depth")) for r in timed) else None}
    cfg = run_dir / "config.yaml"
    if cfg.is_file():
        out["config_yaml"] = f"{name}/config.yaml"
    if steps and not _finite(last.get("loss")):
        problems.append(f"{name}: final loss {last.get('loss')!r} is not finite")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description="Summarise a tools/gpu_check.sh output folder into OUT/summary.json.")
    p.add_argument("out")
    p.add_argument("--mode", choices=("gpu", "cpu_smoke"), required=True)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the medians")
    p.add_argument("--config", default=None, help="training config preset name (recorded)")
    p.add_argument("--runs", nargs="*", default=["bf16"], help="training runs that must be present")
    args = p.parse_args()
    out = Path(args.out)
    if not out.is_dir():
        p.error(f"out: {out} is not a folder (a gpu_check.sh output)")
    if args.warmup < 0:
        p.error(f"--warmup: must be >= 0, got {args.warmup}")
    problems: list[str] = []

    steps: dict[str, dict] = {}
    tsv = out / "steps.tsv"
    if tsv.is_file():
        for n, line in enumerate(tsv.read_text().splitlines(), 1):
            try:
                name, rc, secs = line.split("\t")
                rc, secs = int(rc), int(secs)
            except ValueError:  # a torn or edited line: named, the others still read
                problems.append(f"steps.tsv line {n} is not NAME<TAB>RC<TAB>SECONDS: {line[:80]!r}")
                continue
            steps[name] = {"rc": rc, "seconds": secs}
            if int(rc) != 0:
                why = "timed out" if int(rc) in (124, 137) else f"exit {rc}"
                problems.append(f"step {name} failed ({why}); see {name}.log")
    else:
        problems.append("steps.tsv is missing")

    device = _read_json(out / "device.json", problems) or {}
    cuda = bool(device.get("cuda_available"))
    logits = _read_json(out / "logits.json", problems)
    if logits is not None and not logits.get("fp32_ok"):
        problems.append(f"logits: FP32 max abs error {logits.get('fp32_max_abs_err')} exceeds the tolerance")

    train = {}
    for run in sorted({*args.runs, *(d.name.removeprefix("train_") for d in out.glob("train_*") if d.is_dir())}):
        train[run] = summarize_run(out / f"train_{run}", args.warmup, cuda, problems)
        train[run]["config"] = args.config

    overhead = None
    files = sorted(out.glob("loop_overhead*.json"))
    if files:
        data = _read_json(files[-1], problems) or {}
        overhead = {"file": files[-1].name, **data.get("results", {}), "config": data.get("config")}
        for k in ("ratio_looped_b5_over_gpt12", "ratio_looped_b2_over_gpt12"):
            if not _finite(overhead.get(k)):
                problems.append(f"loop overhead: {k} is {overhead.get(k)!r}")
    else:
        problems.append("loop_overhead*.json is missing")

    # the planner's predictions for the training runs (tools/gpu/plan_calibration.py); informational
    calib = out / "plan_calibration.json"
    plan_calibration = _read_json(calib, []) if calib.is_file() else None  # a torn one fails nothing

    summary = {
        "mode": args.mode, "ok": not problems, "problems": problems,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "device_name": device.get("device"), "torch_version": device.get("torch"),
        "cuda_version": device.get("cuda"), "python": device.get("python"),
        "transformer_engine": device.get("transformer_engine"), "packages": device.get("packages"),
        "steps": steps, "total_seconds": sum(s["seconds"] for s in steps.values()),
        "logits": logits, "train": train, "loop_overhead": overhead, "plan_calibration": plan_calibration,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"== summary ({out / 'summary.json'})")
    print(f"device {summary['device_name']} torch {summary['torch_version']} mode {args.mode}")
    if logits:
        print("logits", {k: logits.get(k) for k in ("fp32_max_abs_err", "bf16_autocast_max_abs_err", "fp32_ok")})
    for run, r in train.items():
        med = {k: (round(v, 4) if _finite(v) else v) for k, v in r["median"].items()}
        print(f"train {run} ({args.config}): {r['steps_in_median']} steps in median {med} final_loss {r['final_loss']}")
    if overhead:
        print("loop overhead", {k: overhead.get(k) for k in ("ratio_looped_b5_over_gpt12",
                                                             "ratio_looped_b2_over_gpt12", "median_step_s")})
    if problems:
        print("gpu_check: PROBLEMS: " + "; ".join(problems), file=sys.stderr)
        sys.exit(1)
    print("gpu_check: all checks passed")


if __name__ == "__main__":
    main()
