"""LR screens: collecting results, results.csv/json, the plot and the console report."""

from __future__ import annotations

import argparse
import csv
import io
import shlex
import time
from pathlib import Path
from typing import Any

from megaloop.runtime.files import atomic_write_json, atomic_write_text, json_safe
from megaloop.screen.core import TERMINAL, WHOLE_SET, Screen, finite, log, lr_tag, point_state, run_name
from megaloop.runtime.files import save_figure


# ====================================================================================== report
def collect(screen: Screen, active: dict[str, str] | None = None) -> list[dict]:
    """Every grid point's state (``active``: run names still in slurm -> job id: "queued")."""
    points = []
    for i, lr in enumerate(screen.lrs):
        st = point_state(screen.run_dir(lr), screen.end_step)
        if active and run_name(lr) in active and st["status"] not in TERMINAL:
            st["status"] = "queued"
        points.append({"index": i, "lr": lr, **st, "target_steps": screen.end_step,
                       "run_dir": str(screen.run_dir(lr))})
    return points


def _fmt(x: Any, spec: str = ".4f") -> str:
    return format(x, spec) if finite(x) else ("" if x is None else str(x))


def write_results(screen: Screen, points: list[dict], sel: dict, argv_cmd: str | None) -> dict:
    out = screen.out
    cols = ["index", "lr", "status", "val_ce", "val_ppl", "val_depth", "steps", "target_steps",
            "final_loss", "exit_code", "best", "run_dir"]
    text = io.StringIO(newline="")
    w = csv.DictWriter(text, fieldnames=cols)
    w.writeheader()
    for p in points:
        w.writerow({**{k: p.get(k) for k in cols}, "lr": lr_tag(p["lr"]),
                    "val_ce": _fmt(p["val_ce"], ".6f"), "val_ppl": _fmt(p["val_ppl"], ".4f"),
                    "final_loss": _fmt(p["final_loss"], ".6f"), "best": int(p["index"] == sel["best_index"])})
    atomic_write_text(out / "results.csv", text.getvalue())
    result = {
        "config": screen.config, "grid": screen.lrs, "stop_after": screen.stop_after,
        "max_steps": screen.max_steps, "eval_depth": screen.eval_depth,
        "eval_batches": None if screen.eval_batches == WHOLE_SET else screen.eval_batches,
        "screen_set": screen.screen_info, "overrides": screen.overrides, "points": points,
        "best": None if sel["best_index"] is None else
        {"index": sel["best_index"], "lr": sel["best_lr"], "val_ce": sel["best_val_ce"],
         "run_dir": points[sel["best_index"]]["run_dir"]},
        "interior": sel["interior"], "edge": sel["edge"], "complete": sel["complete"],
        "all_diverged": bool(sel.get("all_diverged")), "flat": bool(sel.get("flat")), "proposed_grid": sel["proposed_grid"], "proposed_command": argv_cmd,
        "updated": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    atomic_write_json(out / "results.json", json_safe(result), sort_keys=False)  # a diverged point's NaN: null
    return result


def plot(screen: Screen, points: list[dict], sel: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        log("matplotlib is not installed: no screen.png")
        return None
    done = [p for p in points if p["status"] == "done"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    if done:
        ax.plot([p["lr"] for p in done], [p["val_ce"] for p in done], "o-", color="tab:blue",
                label="finished")
    ces = [p["val_ce"] for p in done]
    top = (max(ces) + 0.05 * (max(ces) - min(ces) + 1e-3)) if ces else 1.0
    bad = [p for p in points if p["status"] == "diverged"]
    if bad:
        ax.plot([p["lr"] for p in bad], [top] * len(bad), "x", color="tab:red", ms=9, mew=2,
                label="diverged")
    if sel["best_index"] is not None:
        b = points[sel["best_index"]]
        star = "gold" if sel["interior"] else "tab:red" if sel["edge"] else "0.6"  # grey: provisional
        ax.plot([b["lr"]], [b["val_ce"]], "*", color=star, ms=18,
                mec="black", zorder=5, label=f"best {lr_tag(b['lr'])}: {b['val_ce']:.4f}")
    for lr in screen.lrs:
        ax.axvline(lr, color="0.9", lw=0.8, zorder=0)
    ax.set_xscale("log")
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel(f"validation CE at R={screen.eval_depth} (screen set)")
    title = f"LR screen: {Path(screen.config).stem}, {screen.end_step} of {screen.max_steps} updates"
    if sel.get("all_diverged"):
        title += "\nEVERY POINT DIVERGED: extend the grid below"
    elif sel.get("flat"):
        title += "\nEVERY POINT TIES: no optimum bracketed"
    elif sel["edge"]:
        title += f"\nBEST ON THE {sel['edge'].upper()} EDGE: extend the grid"
    elif not sel["complete"]:
        title += f"\nINCOMPLETE: {len(sel['missing'])} of {len(points)} points missing, best is provisional"
    ax.set_title(title, fontsize=10, color="tab:red" if sel["edge"] else "black")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    ax.grid(True, which="major", alpha=0.3)
    return save_figure(fig, path)


def proposal_command(args: argparse.Namespace, screen: Screen, grid: list[float]) -> str:
    cmd = ["megaloop", "lr-screen", "--config", screen.config,
           "--grid", ",".join(lr_tag(x) for x in grid), "--launcher", args.launcher,
           "--out", str(screen.out), "--stop-after", str(screen.stop_after),
           "--eval-depth", str(screen.eval_depth)]
    if args.screen_set is not None:
        cmd += ["--screen-set", args.screen_set]
    if args.eval_batches is not None:
        cmd += ["--eval-batches", str(args.eval_batches)]
    cmd += launcher_flags(args)
    if screen.overrides:
        cmd += ["--", *screen.overrides]
    return shlex.join(cmd)


def launcher_flags(args: argparse.Namespace) -> list[str]:
    """The launcher options this screen was run with (a proposed extension must run the same way:
    the same slurm partition/account, threads, processes, devices)."""
    out: list[str] = []
    for name in ("parallel", "threads", "threads_per_run", "devices"):
        if getattr(args, name, None) is not None:
            out += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if getattr(args, "nproc", 1) != 1:
        out += ["--nproc", str(args.nproc)]
    out += [f"--sbatch-arg={a}" for a in getattr(args, "sbatch_arg", None) or []]
    if getattr(args, "wait", False):
        out.append("--wait")
        if getattr(args, "poll", None) not in (None, 60.0):
            out += ["--poll", f"{args.poll:g}"]
    return out


def report(screen: Screen, points: list[dict], sel: dict, proposal: str | None) -> None:
    print(f"\nLR screen {screen.config}: stop after {screen.end_step} of {screen.max_steps} updates, "
          f"val CE at R={screen.eval_depth} on {screen.screen_set}")
    print(f"  {'lr':>10}  {'status':<11} {'steps':>11}  {'val_ce':>9}  {'val_ppl':>10}")
    for p in points:
        mark = "  <- best" if p["index"] == sel["best_index"] else ""
        print(f"  {lr_tag(p['lr']):>10}  {p['status']:<11} {p['steps']:>5}/{p['target_steps']:<5}  "
              f"{_fmt(p['val_ce']):>9}  {_fmt(p['val_ppl'], '.2f'):>10}{mark}")
    if not sel["complete"]:
        missing = ", ".join(lr_tag(x) for x in sel["missing"])
        best = "no finished point yet" if sel["best_index"] is None else \
            f"best lr so far {lr_tag(sel['best_lr'])} (val_ce {sel['best_val_ce']:.4f}) is provisional"
        print(f"  the screen is incomplete ({len(sel['missing'])} of {len(points)} point(s) missing: lr {missing}): "
              f"{best}; no edge or interior verdict until every point has finished")
    elif sel.get("all_diverged"):
        bar = "!" * 78
        print(f"\n{bar}\n!! every point of the grid DIVERGED: no learning rate was selected; the optimum lies "
              f"below the grid.\n!! Extend the grid below its lowest point (x1/{sel['ratio']:.3g}):\n"
              f"!!   proposed grid: {','.join(lr_tag(x) for x in sel['proposed_grid'])}\n!!   {proposal}\n{bar}")
    elif sel["best_index"] is None:
        print("  no finished point yet")
    elif sel.get("flat"):
        print(f"  every finished point ties at val_ce {sel['best_val_ce']:.6f}: this budget cannot tell these LRs "
              f"apart, so no optimum is bracketed (lowest listed: {lr_tag(sel['best_lr'])}); screen higher LRs, "
              "or longer (--stop-after)")
    elif sel["interior"]:
        print(f"  best lr {lr_tag(sel['best_lr'])} (val_ce {sel['best_val_ce']:.4f}) is interior to the grid")
    else:
        bar = "!" * 78
        r = sel["ratio"]
        print(f"\n{bar}\n!! WARNING: best lr {lr_tag(sel['best_lr'])} is on the {sel['edge'].upper()} EDGE "
              f"of the grid: the optimum is NOT bracketed.\n"
              f"!! Extend the grid by one log step (x{r:.3g}) beyond that edge; finished points are reused:\n"
              f"!!   proposed grid: {','.join(lr_tag(x) for x in sel['proposed_grid'])}\n"
              f"!!   {proposal}\n{bar}")
