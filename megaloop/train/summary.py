"""Run totals from ``RUN_DIR/metrics.jsonl`` (``tools/run_summary.py``; the reproduction report).

Every logged record carries cumulative counters (``model_flops_total``, ``target_tokens_total``,
``depth_counts``, ``tokens``), so the last record gives exact totals whatever ``log_interval`` was,
and a resumed run continues them from its checkpoint. A resumed run appends to the same file; when
a step was logged twice (a run resumed from an earlier checkpoint) the later record wins.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from megaloop.config_utils import ConfigError


RUN_FILES = ("metrics.jsonl", "config.yaml", "data.json", "tokenizer.json", ".megaloop.lock",
             # what lr-screen / reproduce keep in a run: logs, launch record, exit status
             "train.log", "after.log", "sweep_run.json", "screen_exit", "repro_exit", "wandb_id")
RUN_FOLDERS = ("checkpoints", "eval", "wandb")  # a run's checkpoints, reproduce's evaluation, wandb's files


def is_run_file(path: str | Path, run_dir: str | Path) -> bool:
    """Whether ``path`` is one of ``run_dir``'s own files (its metrics log and rotated copies, config,
    data record, tokenizer, lock, the sweep commands' logs and records, anything under checkpoints/,
    eval/ or wandb/): what a tool must not write over. ``run_dir`` may be given as its metrics file."""
    target, run = Path(path).resolve(), Path(run_dir).resolve()
    if run.is_file():  # RUN/metrics.jsonl given for RUN (summarize takes either): its folder's files
        run = run.parent
    own = {(run / n).resolve() for n in RUN_FILES} | {p.resolve() for p in run.glob("metrics.jsonl*")}
    return target in own or any((run / d).resolve() in target.parents for d in RUN_FOLDERS)


def read_metrics(run_dir: str | Path) -> list[dict]:
    """Records of ``RUN_DIR/metrics.jsonl`` (or of a metrics file given itself) by step (later
    duplicates replace earlier ones; torn lines skipped)."""
    from megaloop.train.metrics import read_metrics as read_lines

    path = Path(run_dir) if Path(run_dir).is_file() else Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"run {run_dir}: no metrics.jsonl (not a megaloop run directory?)")
    by_step = {int(rec["step"]): rec for rec in read_lines(path)}
    return [by_step[k] for k in sorted(by_step)]


def summarize(run_dir: str | Path) -> dict[str, Any]:
    """Totals of a run: steps, tokens, model FLOPs, depth histogram, final prior, val CE."""
    recs = read_metrics(run_dir)
    if not recs:
        raise ConfigError(f"run {run_dir}: metrics.jsonl has no step records")
    last = recs[-1]
    if "model_flops_total" not in last:
        raise ConfigError(f"run {run_dir}: metrics.jsonl predates cumulative counters "
                          "(no model_flops_total); totals cannot be computed exactly")
    counts = {int(k): int(v) for k, v in last.get("depth_counts", {}).items()}
    drawn = sum(counts.values())
    vals = [(r["step"], r["val_ce"]) for r in recs if isinstance(r.get("val_ce"), (int, float))]
    finite = [sv for sv in vals if math.isfinite(sv[1])]  # a NaN compares false: min() kept whichever came first
    best = min(finite, key=lambda sv: sv[1]) if finite else None
    # the prior of the last record that logged one (skipped non-finite steps log none)
    with_prior = next((r for r in reversed(recs) if r.get("prior_probs")), None)
    probs = with_prior.get("prior_probs") if with_prior else None
    out: dict[str, Any] = {
        "run_dir": str(run_dir),
        "steps": int(last["step"]),
        "tokens": int(last.get("tokens", 0)),
        "target_tokens": int(last.get("target_tokens_total", 0)),
        "model_flops": float(last["model_flops_total"]),
        "skipped_steps": int(last.get("skipped_steps_total", 0)),
        "microbatches": drawn,
        "depth_counts": {str(k): counts[k] for k in sorted(counts)},
        "mean_depth_drawn": sum(k * v for k, v in counts.items()) / drawn if drawn else None,
        "final_loss": last.get("loss"),
        "last_val_ce": vals[-1][1] if vals else None,
        "last_val_step": vals[-1][0] if vals else None,
        "best_val_ce": best[1] if best else None,
        "best_val_step": best[0] if best else None,
        "val_ce_per_source": next((r["val_ce_per_source"] for r in reversed(recs) if "val_ce_per_source" in r), None),
    }
    if "counted_from_step" in last:
        out["counted_from_step"] = int(last["counted_from_step"])
    if probs:
        out["prior"] = {"mean_depth": with_prior.get("prior_mean_depth"), "entropy": with_prior.get("prior_entropy"),
                        "p5": probs[4] if len(probs) >= 5 else None, "probs": probs,
                        "step": int(with_prior["step"])}
    return out


def one_line(s: dict[str, Any]) -> str:
    """``steps=... tokens=... model_flops=... mean_depth=... val_ce=... (best ... @step)``."""
    parts = [f"steps={s['steps']}", f"tokens={s['tokens']:,}", f"model_flops={s['model_flops']:.4g}",
             f"mean_depth_drawn={s['mean_depth_drawn']:.3f}" if s["mean_depth_drawn"] is not None else "mean_depth_drawn=-"]
    if s.get("prior"):
        p = s["prior"]
        parts.append(f"prior_mean={p['mean_depth']:.3f} p5={p['p5']:.4f} prior_entropy={p['entropy']:.3f}")
    if s["last_val_ce"] is not None:
        ce = s["last_val_ce"]
        ppl = math.inf if ce >= 700 else math.exp(ce)  # beyond exp's range: inf (was exp(50)); NaN stays NaN
        best = f"{s['best_val_ce']:.4f}@{s['best_val_step']}" if s["best_val_ce"] is not None else "-"
        parts.append(f"val_ce={ce:.4f} (ppl {ppl:.2f}) best={best}")
    return " ".join(parts)
