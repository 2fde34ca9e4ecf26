"""Collect an experiment's arms into ``results.json`` and render ``report.md`` and the PNGs.

``collect`` reads every arm's ``metrics.jsonl`` (training FLOPs, tokens, final prior, curves) and
``eval/summary.json`` (PPL at R, sharing penalty, extrapolation, sweep rows, downstream);
``render`` needs nothing but that results dict, so a report can be re-rendered from a copied
``results.json`` (``megaloop reproduce --render OUT/results.json``). Figures:

* ``ppl_vs_depth.png``: native PPL against recurrences per looped arm (untied: a flat line); at a
  scale without a PPL sweep, the synthetic task's answer accuracy against recurrences;
* ``prior_evolution.png``: prior mean depth, p(5) and entropy over training, and the final p(r);
* ``training_curves.png``: training loss (EMA-smoothed) and the trainer's validation CE.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from megaloop.errors import UserError
from megaloop.model.config import ModelConfig
from megaloop.repro.evaluate import SUMMARY, machine, synth_curve
from megaloop.repro.runs import arm_state, run_dir
from megaloop.repro.spec import METRICS, Plan
from megaloop.repro.verdicts import Check, check_text, claim_verdict, mean_sd, verdict_text
from megaloop.runtime.files import atomic_write_json, json_safe, save_figure
from megaloop.train.metrics import read_metrics

TABLE = ("native_ppl", "terminal_ppl", "sharing_penalty_pct", "extrapolation_pct", "train_flops", "prior_mean",
         "prior_p5", "prior_entropy", "downstream")
SYNTH_TABLE = ("synth_acc_r1", "synth_acc", "synth_extrap_pts")  # shown when an arm has them
MAX_CURVE_POINTS = 400
MAX_PRIOR_ROWS = 120


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _thin(n: int, keep: int) -> list[int]:
    """Indices of at most ``keep`` evenly spaced items of ``n`` (always the last)."""
    if n <= keep:
        return list(range(n))
    idx = sorted({round(i * (n - 1) / (keep - 1)) for i in range(keep)})
    return idx


def _data_sha(run_dir: Path) -> str | None:
    """Content fingerprint of the data a run trained on (its ``data.json``, written by the
    trainer), None for runs made before it was recorded."""
    try:
        return ((json.loads((Path(run_dir) / "data.json").read_text()).get("content") or {}).get("sha256"))
    except (OSError, ValueError):
        return None


def train_summary(rows: list[dict], tokens_per_step: int, looped: bool) -> dict:
    """Figures of one arm's training log (rows deduplicated by step: a resume re-logs steps)."""
    by_step: dict[int, dict] = {}
    for r in rows:
        by_step[r["step"]] = r
    rows = [by_step[s] for s in sorted(by_step)]
    out: dict[str, Any] = {"steps": rows[-1]["step"] if rows else 0}
    if not rows:
        return out
    last = rows[-1]
    if _finite(last.get("model_flops_total")):
        out["train_flops"], out["flops_source"] = float(last["model_flops_total"]), "model_flops_total"
    elif any(_finite(r.get("model_flops")) for r in rows):
        out["train_flops"] = float(sum(r["model_flops"] for r in rows if _finite(r.get("model_flops"))))
        out["flops_source"] = "sum of logged model_flops"
    out["tokens"] = out["steps"] * tokens_per_step
    # each logged step's time stands for the steps since the previous logged one (log_interval > 1)
    gaps = [r["step"] - (rows[i - 1]["step"] if i else 0) for i, r in enumerate(rows)]
    out["train_seconds"] = float(sum(r["step_time_s"] * g for r, g in zip(rows, gaps) if _finite(r.get("step_time_s"))))
    out["final_loss"] = last.get("loss")
    val = [r for r in rows if _finite(r.get("val_ce"))]
    out["val_ce"] = val[-1]["val_ce"] if val else None
    if looped and isinstance(last.get("prior_probs"), list):
        probs = last["prior_probs"]
        out["prior_mean"] = last.get("prior_mean_depth", sum((i + 1) * p for i, p in enumerate(probs)))
        out["prior_p5"] = probs[4] if len(probs) >= 5 else 0.0
        out["prior_entropy"] = last.get("prior_entropy")
        out["prior_probs"] = probs
    if isinstance(last.get("depth_counts"), dict):
        out["depth_counts"] = last["depth_counts"]
    keep = _thin(len(rows), MAX_CURVE_POINTS)
    out["curve"] = {"step": [rows[i]["step"] for i in keep], "loss": [rows[i].get("loss") for i in keep],
                    "val_step": [r["step"] for r in val], "val_ce": [r["val_ce"] for r in val]}
    pri = [r for r in rows if isinstance(r.get("prior_probs"), list)] if looped else []
    if pri:
        keep = _thin(len(pri), MAX_PRIOR_ROWS)
        out["prior_history"] = {"step": [pri[i]["step"] for i in keep],
                                "mean": [pri[i].get("prior_mean_depth") for i in keep],
                                "entropy": [pri[i].get("prior_entropy") for i in keep],
                                "probs": [pri[i]["prior_probs"] for i in keep]}
    return out


def _finish(fig, ax, path: Path) -> Path:
    """Grid, legend (when anything is labelled), save and close a one-axes figure."""
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    return save_figure(fig, path)


def _portable(path: Any, base: Path | None = None) -> str:
    """``path`` relative to ``base`` (the experiment dir) or to the repository (shipped experiment
    files); else its name: results.json names no machine paths."""
    p = Path(str(path)).resolve()
    for root in ([base.resolve()] if base is not None else []) + [Path(__file__).resolve().parents[2]]:
        try:
            return str(p.relative_to(root))
        except ValueError:
            continue
    return p.name


def _lr_of(overrides: list[str]) -> float | None:
    lrs = [o.split("=", 1)[1] for o in overrides if o.startswith("optim.lr=")]
    try:
        return float(lrs[-1]) if lrs else None
    except ValueError:
        return None


def collect(out: Path, plan: Plan, active: dict[str, str] | None = None, launcher: dict | None = None,
            screens: dict[str, dict] | None = None, waiting: list[str] = ()) -> dict:
    """Results of every run of ``plan`` in ``out`` (``active``: runs still in slurm -> job id;
    ``screens``: each screened arm's ``runs.screen_result``; ``waiting``: runs whose LR screen is
    not finished)."""
    import json

    active = active or {}
    arms, machines = [], []
    for arm in plan.arms:
        rd = run_dir(out, arm)
        st = arm_state(out, plan, arm)
        status = "queued" if arm.name in active and st["status"] != "done" else st["status"]
        if arm.name in waiting and status == "pending":
            status = "waiting"
        entry: dict[str, Any] = {"name": arm.name, "group": arm.arm, "seed": arm.seed, "lr": _lr_of(arm.overrides),
                                 "lr_source": arm.lr, "label": arm.label, "looped": arm.looped,
                                 "depth_kind": arm.depth_kind, "overrides": arm.overrides, "status": status,
                                 "step": st["step"], "exit_code": st["exit_code"],
                                 "run_dir": _portable(rd, Path(out))}
        entry["data"] = _data_sha(rd)
        entry["train"] = train_summary(read_metrics(rd / "metrics.jsonl"), plan.settings["tokens_per_step"],
                                       arm.looped)
        metrics = {k: entry["train"].get(k) for k in ("train_flops", "prior_mean", "prior_p5", "prior_entropy",
                                                       "val_ce", "final_loss")}
        summary_path = rd / "eval" / SUMMARY
        if summary_path.is_file():
            try:
                s = json.loads(summary_path.read_text())
            except ValueError:
                s = {}
            if s.get("step") == st["step"]:  # never report an evaluation of an older checkpoint
                metrics.update({k: v for k, v in (s.get("metrics") or {}).items()})
                entry["eval_complete"] = bool(s.get("complete"))
                if s.get("machine"):
                    machines.append(s["machine"])
        entry["metrics"] = metrics
        arms.append(entry)
    screens = {g: {k: v for k, v in r.items() if k != "points"}
               | {"points": [{k: p.get(k) for k in ("lr", "status", "val_ce", "steps")} for p in r["points"]]}
               for g, r in (screens or {}).items()}
    res = {"experiment": plan.experiment, "description": plan.description, "source": _portable(plan.source),
           "scale": plan.scale, "config": plan.config, "note": plan.note, "settings": plan.settings,
           "extras": plan.extras, "eval": plan.eval.to_dict(), "seeds": plan.seeds,
           "claims": [c.__dict__ for c in plan.claims], "arms": arms, "screens": screens,
           "machine": machines[0] if machines else machine(), "launcher": launcher or {},
           "defaults_revision": ModelConfig.DEFAULTS_REVISION,
           "complete": all(a["status"] == "done" for a in arms), "updated": time.strftime("%Y-%m-%d %H:%M:%S")}
    return add_verdicts(res)


def groups(results: dict) -> list[dict]:
    """The experiment file's arms over their seeds: ``{name, label, runs, n, status, mean, sd}``;
    mean and sample sd of every numeric metric over the runs that are done (sd None for n < 2)."""
    out: dict[str, dict] = {}
    for a in results["arms"]:
        g = out.setdefault(a.get("group") or a["name"], {"name": a.get("group") or a["name"], "label": a["label"],
                                                         "looped": a["looped"], "runs": [], "done": []})
        g["runs"].append(a)
        if a["status"] == "done":
            g["done"].append(a)
    rows = []
    for g in out.values():
        done = g.pop("done")
        runs = g.pop("runs")
        mean, sd = {}, {}
        keys = {k for a in done for k, v in a["metrics"].items() if _finite(v)}
        for k in sorted(keys):
            xs = [a["metrics"][k] for a in done if _finite(a["metrics"].get(k))]
            if len(xs) != len(done):
                continue
            mean[k], sd[k] = mean_sd(xs)
        status = "done" if len(done) == len(runs) else ", ".join(sorted({a["status"] for a in runs if a["status"] != "done"}))
        rows.append({**g, "runs": [a["name"] for a in runs], "n": len(done), "status": status,
                     "lr": sorted({a["lr"] for a in runs if a.get("lr") is not None}), "mean": mean, "sd": sd})
    return rows


def verdicts(results: dict) -> list[dict]:
    """Each claim's computed verdict (``verdicts.claim_verdict``) from the runs that are done."""
    by_seed: dict[str, dict] = {}
    for a in results["arms"]:
        if a["status"] == "done":
            by_seed.setdefault(a.get("group") or a["name"], {})[a.get("seed")] = a["metrics"]
    return [claim_verdict([Check(**c) for c in claim.get("expect") or []], by_seed) for claim in results["claims"]]


def add_verdicts(results: dict) -> dict:
    """``results["verdicts"]``: each claim's id and computed verdict; returns ``results``."""
    results["verdicts"] = [{"id": c["id"], **v} for c, v in zip(results["claims"], verdicts(results))]
    return results


# what render / print_table / merge read unguarded: a results.json has at least these, of these types
RESULTS_SHAPE = {"experiment": str, "scale": str, "config": str, "source": str, "updated": str, "complete": bool,
                 "settings": dict, "eval": dict, "arms": list, "claims": list}
_JSON_TYPES = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number",
               type(None): "null"}


# the nested fields the report, merge and verdicts read (arms[i], claims[i], claims[i].expect[j], eval, settings)
_NESTED_SHAPE = {"arms": {"name": str, "label": str, "looped": bool, "status": str, "overrides": list, "train": dict,
                          "metrics": dict},
                 "claims": {"id": str, "claim": str, "metrics": list, "arms": list},  # + optional "expect"
                 "eval": {"depth": int, "depths": list},
                 "settings": {"max_steps": int, "tokens_per_step": int}}
_CHECK_SHAPE = {"arm": str, "metric": str, "op": str}


def _shape_errors(obj: dict, shape: dict, where: str) -> list[str]:
    return [f"{where}.{k} ({_JSON_TYPES[t]})" for k, t in shape.items() if not isinstance(obj.get(k), t)]


def check_results(results: Any, where: str) -> dict:
    """``results`` (read from ``where``) if it is a ``megaloop reproduce`` results file, else a
    :class:`UserError` naming ``where`` and what was expected (top-level keys, then each arm's,
    claim's and check's fields, ``eval`` and ``settings``)."""
    head = f"{where}: not a `megaloop reproduce` results file"
    if not isinstance(results, dict):
        raise UserError(f"{head}: expected a JSON object with keys {', '.join(RESULTS_SHAPE)}, "
                        f"got a JSON {_JSON_TYPES.get(type(results), '?')}")
    bad = [f"{k} ({_JSON_TYPES[t]})" for k, t in RESULTS_SHAPE.items() if not isinstance(results.get(k), t)]
    if bad:
        raise UserError(f"{head}: expected keys missing or of another type: {', '.join(bad)}")
    for key in ("eval", "settings"):
        bad += _shape_errors(results[key], _NESTED_SHAPE[key], key)
    for key in ("arms", "claims"):
        for i, item in enumerate(results[key]):
            if not isinstance(item, dict):
                bad.append(f"{key}[{i}] (object, got {_JSON_TYPES.get(type(item), '?')})")
                continue
            bad += _shape_errors(item, _NESTED_SHAPE[key], f"{key}[{i}]")
            checks = item.get("expect") if key == "claims" else None
            if checks is not None and not isinstance(checks, list):
                bad.append(f"{key}[{i}].expect (array)")
            for j, check in enumerate(checks if isinstance(checks, list) else []):
                bad += ([f"{key}[{i}].expect[{j}] (object)"] if not isinstance(check, dict)
                        else _shape_errors(check, _CHECK_SHAPE, f"{key}[{i}].expect[{j}]"))
    if bad:
        more = f" and {len(bad) - 8} more" if len(bad) > 8 else ""
        raise UserError(f"{head}: expected fields missing or of another type: {', '.join(bad[:8])}{more}")
    return results


def write_results(out: Path, results: dict) -> Path:
    path = Path(out) / "results.json"
    atomic_write_json(path, json_safe(results), indent=1, sort_keys=False)  # a diverged arm's NaN: null
    return path


# ----------------------------------------------------------------------------- formatting
def fmt(metric: str, x: Any) -> str:
    """Text of one table cell (``—`` for a missing value)."""
    if not _finite(x):
        return "—" if x is None else str(x)
    x = x + 0.0  # no "-0.000"
    if abs(x) < 5e-4 and not metric.endswith("_pct") and metric != "train_flops":
        x = 0.0
    if metric.endswith("_pct"):
        return f"{x:+.2f}"
    if metric == "train_flops":
        return f"{x:.3e}"
    if metric == "synth_extrap_pts":
        return f"{x:+.1f}"
    if metric in ("prior_p5", "downstream", "synth_acc", "synth_acc_r1"):
        return f"{x:.3f}"
    if metric in ("prior_mean", "prior_entropy", "val_ce", "final_loss"):
        return f"{x:.3f}"
    return f"{x:.2f}" if abs(x) < 1e5 else f"{x:.4g}"


def table_columns(rows: list[dict]) -> tuple[str, ...]:
    """The main table's metrics: ``TABLE``, plus the synthetic-task columns when an arm has them."""
    synth = any(_finite(g["mean"].get(k)) for g in rows for k in SYNTH_TABLE)
    return TABLE + (SYNTH_TABLE if synth else ())


def label(results: dict, metric: str) -> str:
    """Column label of ``metric`` (the extrapolation names the sweep's deepest depth)."""
    if metric == "extrapolation_pct":
        return f"R={max(results['eval']['depths'])} extrap. %"
    return METRICS[metric]


def cell(metric: str, group: dict) -> str:
    """A table cell of one arm over its seeds: ``mean`` or ``mean ± sd``."""
    text = fmt(metric, group["mean"].get(metric))
    sd = group["sd"].get(metric)
    return f"{text} ± {fmt(metric, sd).lstrip('+')}" if _finite(sd) else text


def _rel(a: Any, b: Any) -> float | None:
    return 100.0 * (a / b - 1.0) if _finite(a) and _finite(b) and b != 0 else None


def claim_measured(claim: dict, arms: dict[str, dict], labels: dict[str, str] | None = None) -> str:
    """The measured figure of one claim row, e.g. ``b2: R=64 extrap. % +1.20, sharing penalty % +0.30``."""
    labels = labels or METRICS
    parts = []
    for name in claim["arms"]:
        m = arms[name]["metrics"] if name in arms else {}
        if claim.get("relative_to"):
            ref = arms.get(claim["relative_to"], {}).get("metrics", {})
            vals = ", ".join(f"{labels[k]} {fmt('x_pct', _rel(m.get(k), ref.get(k)))} %" for k in claim["metrics"])
            parts.append(f"{name} vs {claim['relative_to']}: {vals}")
        else:
            vals = ", ".join(f"{labels[k]} {fmt(k, m.get(k))}" for k in claim["metrics"])
            parts.append(f"{name}: {vals}")
    return "; ".join(parts)


def _md_escape(s: str) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def render_markdown(results: dict) -> str:
    s, ev = results["settings"], results["eval"]
    m = results.get("machine") or {}
    mach = f"{m.get('cpu', 'unknown CPU')}, {m.get('cpus', '?')} logical CPUs"
    if m.get("gpus"):
        mach += ", " + ", ".join(m["gpus"])
    mach += f"; {m.get('platform', '')}, Python {m.get('python', '?')}, torch {m.get('torch', '?')}"
    la = results.get("launcher") or {}
    lines = [f"# Experiment `{results['experiment']}` at scale `{results['scale']}`", ""]
    if results.get("description"):
        lines += [results["description"], ""]
    tokens = s["max_steps"] * s["tokens_per_step"]
    lines += [
        f"- **Scale**: `{results['scale']}` (preset `{results['config']}`); {s['max_steps']:,} steps x "
        f"{s['global_batch_size']} x {s['seq_len']} tokens = {tokens:,} tokens per arm"
        + (f"; {results['note']}" if results.get("note") else ""),
        f"- **Same for every arm**: seed {s['seed']}, data `{s['data_path']}` (shuffle {s['shuffle']}, "
        f"shuffle seed {s['shuffle_seed']}), so the same data order at one seed",
        f"- **Evaluation**: R={ev['depth']} (training depth), sweep {ev['depths']}, "
        f"{'terminal vs per-visit KV' if ev['sharing'] else 'no sharing'}, "
        f"{ev['max_seqs'] or 'all'} validation sequences of `{ev['data']}`; downstream = mean acc of "
        f"{', '.join(ev['harness']) or 'no tasks'}"
        + (f"; synthetic task `{ev['synth']}` at every sweep depth, accuracy over held-out k >= "
           f"{ev.get('synth_min_k', 3)} (synth acc R_max − R = accuracy change from R to R={max(ev['depths'])})"
           if ev.get("synth") else ""),
        f"- **Machine**: {mach}",
    ]
    if la:
        lines.append("- **Launcher**: " + ", ".join(f"{k} {v}" for k, v in la.items()))
    lines += [f"- Source: `{Path(results['source']).name}`; updated {results['updated']}"
              + ("" if results["complete"] else " — **incomplete: some arms are not finished**"), ""]
    seeds = results.get("seeds")
    if seeds:
        lines += [f"- **Seeds**: {seeds} (`train.seed`: initial weights, depth draws and data order, whose shuffle seed is "
                  "`data.shuffle_seed` + `train.seed`, all change with the seed): cells are "
                  "mean ± sample sd over the seeds that finished", ""]
    rows = groups(results)
    with_lr = any(g["lr"] for g in rows)
    cols = table_columns(rows)
    head = ["arm"] + (["LR"] if with_lr else []) + [label(results, k) for k in cols]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g in rows:
        name = g["label"] if g["label"] == g["name"] else f"{g['label']} (`{g['name']}`)"
        if g["status"] != "done":
            name += f" [{g['status']}]"
        lr = [", ".join(f"{x:g}" for x in g["lr"]) or "—"] if with_lr else []
        lines.append("| " + " | ".join([_md_escape(name)] + lr + [cell(k, g) for k in cols]) + " |")
    lines += ["", f"Sharing penalty = 100·(PPL_terminal/PPL_per-visit − 1) at R; R={max(results['eval']['depths'])} "
              "extrapolation = 100·(PPL@R_max/PPL@R − 1) (native); training FLOPs are model FLOPs (SPEC §6); prior columns "
              "are the final depth distribution (p(5) = probability of depth 5).", ""]
    means = {g["name"]: {"metrics": g["mean"]} for g in rows}
    labels = {k: label(results, k) for k in METRICS}
    if results.get("claims"):
        lines += ["## Paper claims (SPEC §12) beside this run", "",
                  "The paper's figures are for its S/M/L models; at a small scale compare directions, not values. "
                  "Verdicts are computed from each claim's `expect:` checks (megaloop/repro/verdicts.py): holds / "
                  "opposite when the 95 % interval over seeds (or the check's noise floor) is on one side, "
                  "else within noise.",
                  "", "| # | claim | paper | measured here | verdict |", "|---|---|---|---|---|"]
        for c, v in zip(results["claims"], verdicts(results)):
            detail = "; ".join(check_text(r) for r in v["checks"])
            lines.append(f"| {c['id']} | {_md_escape(c['claim'])} | {_md_escape(c['paper'])} | "
                         f"{_md_escape(claim_measured(c, means, labels))} | **{verdict_text(v)}**"
                         + (f": {_md_escape(detail)}" if detail else "") + " |")
        lines.append("")
    for g, sc in (results.get("screens") or {}).items():
        pts = ", ".join(f"{p['lr']:g}: " + (f"{p['val_ce']:.4f}" if _finite(p.get("val_ce")) else p["status"])
                        for p in sc["points"])
        where = (f"**every point diverged** (extend the grid below: {sc.get('proposed_grid')})"
                 if sc.get("all_diverged") else "no finished point" if sc.get("best_lr") is None
                 else "provisional: the screen is incomplete" if sc.get("complete") is False
                 else "**every point ties**: no optimum bracketed; screen higher LRs or longer" if sc.get("flat")
                 else "interior" if sc.get("interior")
                 else f"**{sc.get('edge')} edge** (extend the grid: {sc.get('proposed_grid')})")
        lines += [f"- **LR screen of `{g}`** (val CE at R={sc.get('eval_depth')} on `{sc.get('screen_set')}`, "
                  f"stopped after {sc.get('stop_after')} updates): {pts}; selected "
                  f"{fmt('x', sc.get('best_lr')) if sc.get('best_lr') is None else format(sc['best_lr'], 'g')} ({where})"]
    if results.get("screens"):
        lines.append("")
    lines += ["## Runs", "", "| run | status | seed | LR | steps | tokens | train s | final loss | val CE | overrides |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for a in results["arms"]:
        t = a["train"]
        own = [o for o in a["overrides"] if not o.startswith(("logging.", "train.eval_depth="))]
        lr = f"{a['lr']:g}" if a.get("lr") is not None else "config"
        seed = a.get("seed") if a.get("seed") is not None else results["settings"].get("seed")
        lines.append(f"| `{a['name']}` | {a['status']} | {seed} | {lr} | {t.get('steps', 0)} | {t.get('tokens', 0):,} | "
                     f"{fmt('s', t.get('train_seconds'))} | {fmt('final_loss', t.get('final_loss'))} | "
                     f"{fmt('val_ce', t.get('val_ce'))} | `{_md_escape(' '.join(own))}` |")
    depth_plot = "accuracy vs depth" if ev.get("sweep") is False else "PPL vs depth"
    lines += ["", f"![{depth_plot}](ppl_vs_depth.png)", "", "![prior evolution](prior_evolution.png)", "",
              "![training curves](training_curves.png)", ""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- figures
def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def plot_depth(results: dict, path: Path) -> Path:
    """Native PPL against R per arm; on a scale without a PPL sweep (``eval.sweep: false``), the
    synthetic task's answer accuracy (mean over k >= ``eval.synth_min_k``) against R."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    ev = results["eval"]
    depths = ev["depths"]
    if ev.get("sweep") is False:
        min_k = ev.get("synth_min_k", 3)
        for a in results["arms"]:
            table = a["metrics"].get("synth_table")
            curve = synth_curve(table, min_k) if table else None
            if curve:
                ax.plot(table["depths"], curve, "o-", ms=3, label=a["label"])
        ax.set_ylabel(f"held-out answer accuracy (mean over k >= {min_k})")
        title = "answer accuracy vs depth"
    else:
        for a in results["arms"]:
            rows = [r for r in a["metrics"].get("sweep") or [] if _finite(r.get("native_ppl"))]
            if not rows:
                continue
            if a["looped"]:
                ax.plot([r["depth"] for r in rows], [r["native_ppl"] for r in rows], "o-", ms=3, label=a["label"])
            else:
                ax.axhline(rows[0]["native_ppl"], ls="--", lw=1, color="grey")
                ax.text(depths[0], rows[0]["native_ppl"], f" {a['label']}", fontsize=7, va="bottom", color="grey")
        ax.set_ylabel("native validation PPL")
        title = "PPL vs depth"
    ax.axvline(ev["depth"], color="black", lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_xticks(depths)
    ax.set_xticklabels([str(d) for d in depths])
    ax.set_xlabel("recurrences R (evaluation)")
    ax.set_title(f"{results['experiment']} ({results['scale']}): {title}", fontsize=10)
    return _finish(fig, ax, path)


def plot_prior(results: dict, path: Path, max_depth: int = 20) -> Path:
    plt = _plt()
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5), dpi=110)
    (a_mean, a_p5), (a_ent, a_final) = axes
    any_prior = False
    for a in results["arms"]:
        h = a["train"].get("prior_history")
        if not h:
            continue
        any_prior = True
        a_mean.plot(h["step"], h["mean"], label=a["label"])
        a_p5.plot(h["step"], [p[4] if len(p) >= 5 else 0.0 for p in h["probs"]], label=a["label"])
        a_ent.plot(h["step"], h["entropy"], label=a["label"])
        final = h["probs"][-1][:max_depth]
        a_final.plot(range(1, len(final) + 1), final, "o-", ms=3, label=a["label"])
    for ax, title in ((a_mean, "prior mean depth"), (a_p5, "p(5)"), (a_ent, "prior entropy (nats)"),
                      (a_final, f"final p(r), r <= {max_depth}")):
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.set_xlabel("depth r" if ax is a_final else "step")
    if any_prior:
        a_mean.legend(fontsize=7)
    else:
        a_mean.text(0.5, 0.5, "no depth prior logged", ha="center", transform=a_mean.transAxes)
    fig.suptitle(f"{results['experiment']} ({results['scale']}): depth prior over training", fontsize=10)
    return save_figure(fig, path)


def _ema(xs: list, decay: float = 0.9) -> list:
    out, m = [], None
    for x in xs:
        if not _finite(x):
            out.append(None)
            continue
        m = x if m is None else decay * m + (1 - decay) * x
        out.append(m)
    return out


def plot_curves(results: dict, path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    for a in results["arms"]:
        c = a["train"].get("curve")
        if not c or not c["step"]:
            continue
        (line,) = ax.plot(c["step"], _ema(c["loss"]), lw=1.2, label=a["label"])
        if c["val_step"]:
            ax.plot(c["val_step"], c["val_ce"], "D", ms=5, color=line.get_color())
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training CE (EMA 0.9); ◆ validation CE")
    ax.set_title(f"{results['experiment']} ({results['scale']}): training curves", fontsize=10)
    return _finish(fig, ax, path)


def render(results: dict, out: Path) -> list[Path]:
    """Write ``report.md`` and the three PNGs into ``out``; returns their paths. All four are made in a
    hidden staging folder first, so a failure leaves ``out``'s previous report as it was."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=".render-", dir=out))
    try:
        (stage / "report.md").write_text(render_markdown(results))
        plot_depth(results, stage / "ppl_vs_depth.png")
        plot_prior(results, stage / "prior_evolution.png")
        plot_curves(results, stage / "training_curves.png")
        names = ("report.md", "ppl_vs_depth.png", "prior_evolution.png", "training_curves.png")
        for name in names:
            os.replace(stage / name, out / name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return [out / name for name in names]


def print_table(results: dict) -> None:
    """The main table on the console (plain text)."""
    grouped = groups(results)
    metrics = table_columns(grouped)
    cols = ["arm", "status"] + [label(results, k) for k in metrics]
    rows = [[g["name"], g["status"] if g["n"] <= 1 else f"{g['status']} ({g['n']} seeds)"]
            + [cell(k, g) for k in metrics] for g in grouped]
    widths = [max(len(str(r[i])) for r in [cols] + rows) for i in range(len(cols))]
    print(f"\n{results['experiment']} at scale {results['scale']}:")
    for r in [cols] + rows:
        print("  " + "  ".join(str(x).rjust(w) if i > 1 else str(x).ljust(w) for i, (x, w) in enumerate(zip(r, widths))))
    for c, v in zip(results.get("claims") or [], verdicts(results)):
        if v["verdict"] is not None:
            print(f"  {c['id']}: {verdict_text(v)} — {c['claim']}")


__all__ = ["add_verdicts", "cell", "check_results", "collect", "claim_measured", "fmt", "groups", "print_table",
           "render", "render_markdown", "train_summary", "verdicts", "write_results"]
