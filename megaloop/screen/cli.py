"""``megaloop lr-screen``: learning-rate screens (SPEC §11): one short run per LR of a log-spaced
grid, select by the validation CE at depth R=5 on the frozen LR-screen set, and check the optimum
is bracketed.

    megaloop lr-screen --config S --out runs/screen_S                      # paper range, 7 points
    megaloop lr-screen --config tiny --grid 1e-3,3e-3,1e-2 --out runs/scr --stop-after 20
    megaloop lr-screen --config L --launcher slurm --wait --screen-set /data/eval/screen \\
        --out runs/screen_L -- data.path=/data/txt360_mds

(``python tools/lr_screen.py ...`` is the same command.) Each point is ``megaloop train --config C
--run-dir OUT/lr_<lr> --resume auto optim.lr=<lr> train.stop_after=<N> data.val_path=<screen set>
train.eval_depth=5 train.eval_batches=<K> ...``: the config's full ``train.max_steps`` horizon (so
the WSD schedule of the full run) is kept and the run stops after N updates; its last metrics line
carries ``val_ce`` at depth 5 on the screen set. The points run on megaloop/sweep.py (local
process pool or one slurm array job).

Outputs in OUT: ``results.csv``, ``results.json``, ``screen.png`` (CE vs LR, log x, best marked),
``screen.json`` (the screen's fixed settings), ``launches.jsonl`` (one line per training launch),
``lr_<lr>/`` run directories (``train.log``, ``metrics.jsonl``, ``checkpoints/``, ``screen_exit``).

Resumable: rerunning the same command skips finished points (final step logged with ``val_ce``),
resumes unfinished ones from their latest checkpoint, and keeps diverged ones. A grid extended by a
point reuses every finished run in OUT (the run directories are keyed by LR).

Exit status: 0 screen complete (an edge optimum is reported loudly but is not an error unless
``--fail-on-edge``: 3); 1 some point failed or is unfinished (with ``--fail-on-edge`` also while
points are still queued under slurm: an incomplete screen has no edge verdict, and never exits 3);
2 bad arguments / config; 130 interrupted. A complete screen whose every point diverged selected
nothing: 1 (3 with ``--fail-on-edge``), with a grid one log step lower proposed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megaloop.errors import UserError
from megaloop.runtime.files import atomic_write_json, nonempty_path
from megaloop.screen import report as rep
from megaloop.screen.core import (SCALE_DEFAULTS, TERMINAL, WHOLE_SET, build_screen, check_fixed_settings, finite,
                                  log, lr_tag, point_state, select_best)
from megaloop.sweep import Run, add_launch_args, execute, launch_from_args, pending, run_cli, slurm_active
from megaloop.sweep_out import check_out_dir, check_out_kind, check_out_outside_data

PROG = "megaloop lr-screen"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Learning-rate screen (SPEC §11): short runs over a log-spaced LR grid, selected "
        "by validation CE at R=5 on the frozen screen set.",
        epilog="Per-scale defaults (used when --grid/--range/--stop-after are not given):\n"
        + "\n".join(f"  {k:<5} range [{v['range'][0]:g}, {v['range'][1]:g}], {v['points']} points, "
                    f"stop after {v['stop_after']}" for k, v in SCALE_DEFAULTS.items())
        + "\n  (untied4/untied12 use S's)\nExtra dotlist overrides for every run go after --.")
    p.add_argument("--config", required=True, help="preset (tiny, S, M, L, untied4, untied12) or YAML path")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--grid", help="comma-separated learning rates, e.g. 5e-4,1e-3,2e-3")
    g.add_argument("--range", help="LO,HI: log-spaced grid of --points values from LO to HI")
    p.add_argument("--points", type=int, help="number of grid points for --range (>= 3)")
    p.add_argument("--out", required=True, type=nonempty_path, help="screen directory (run dirs, results.csv/json, screen.png)")
    p.add_argument("--stop-after", type=int, help="updates per screen run (absolute step count)")
    p.add_argument("--screen-set", help="MDS LR-screen set (default: the embedded corpus's 'default:screen' "
                   "when data.path is the embedded default; required otherwise)")
    p.add_argument("--eval-depth", type=int, default=5, help="recurrence depth of the selection CE (5)")
    p.add_argument("--eval-batches", type=int, metavar="K", help="validation covers K x train.global_batch_size "
                   "sequences of the screen set (train.eval_batches; default: the whole set)")
    p.add_argument("--fail-on-edge", action="store_true",
                   help="exit 3 when the best LR of the complete screen is on a grid edge "
                        "(an incomplete screen has no edge verdict: exit 1)")
    add_launch_args(p, default_parallel="1")
    return p


def _summary(run_dir: Path, end_step: int) -> tuple[str, str]:
    """(status, "status (step s/N, val_ce=x)") of one point."""
    st = point_state(run_dir, end_step)
    ce = f", val_ce={st['val_ce']:.4f}" if finite(st["val_ce"]) else ""
    return st["status"], f"{st['status']} (step {st['steps']}/{end_step}{ce})"


def run_screen(args: argparse.Namespace, extras: list[str]) -> int:
    """The screen: launch the unfinished points, then collect, plot and report."""
    screen = build_screen(args, extras)
    check_out_kind(screen.out, "lr-screen")
    check_out_outside_data(screen.out, {"data.path": screen.data_path, "--screen-set": screen.screen_set})
    check_out_dir(str(screen.out), probe=not args.dry_run)  # after: inside a read-only dataset is named as such
    launch = launch_from_args(args, default_parallel=1)
    if args.collect and not ((screen.out / "screen.json").is_file() or any(screen.run_dir(lr).is_dir()
                                                                          for lr in screen.lrs)):
        raise UserError(f"--collect: {screen.out} holds no LR screen (no screen.json, no run folder of the grid); "
                        "nothing to collect")
    check_fixed_settings(screen)  # also for --dry-run: it only reads
    batches = ("whole set" if screen.eval_batches == WHOLE_SET else
               f"{screen.eval_batches} x {screen.global_batch_size} sequences")
    log(f"config {screen.config}: {len(screen.lrs)} points {[lr_tag(x) for x in screen.lrs]}, stop after "
        f"{screen.end_step} of {screen.max_steps} updates, val CE at R={screen.eval_depth} on "
        f"{screen.screen_set} ({batches})")
    if screen.end_step <= screen.warmup_steps:
        log(f"warning: the screen stops at step {screen.end_step}, inside the LR warm-up "
            f"(optim.warmup_steps={screen.warmup_steps}): no run reaches its peak LR")
    if not args.dry_run:
        screen.out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(screen.out / "screen.json",
                          {**screen.fixed(), "grid": screen.lrs, "screen_set_info": screen.screen_info},
                          sort_keys=False)
    sweep = screen.sweep()
    active = slurm_active(sweep) if launch.launcher == "slurm" and not args.dry_run else {}

    def finished(run: Run) -> str | None:
        status, text = _summary(run.run_dir, screen.end_step)
        return text if status in TERMINAL else None

    def on_exit(run: Run, _code: int) -> None:
        log(f"{run.name}: {_summary(run.run_dir, screen.end_step)[1]}")

    code, active = execute(sweep, pending(sweep, active, finished), launch, active, on_exit=on_exit)
    if args.dry_run:
        return 0

    points = rep.collect(screen, active)
    sel = select_best(points)
    proposal = rep.proposal_command(args, screen, sel["proposed_grid"]) if sel["proposed_grid"] else None
    rep.write_results(screen, points, sel, proposal)
    png = rep.plot(screen, points, sel, screen.out / "screen.png")
    rep.report(screen, points, sel, proposal)
    print(f"  results: {screen.out / 'results.csv'}, {screen.out / 'results.json'}" + (f", {png}" if png else ""))
    if code:
        return code
    if any(p["status"] in ("failed", "interrupted", "partial", "pending") for p in points):
        return 1  # "queued" (still in slurm) is not a failure
    if sel.get("all_diverged"):
        return 3 if args.fail_on_edge else 1  # no LR selected: not a finished screen
    if args.fail_on_edge and not sel["complete"]:
        return 1  # points still queued: no edge verdict yet, and asked for one
    if (sel["edge"] or sel.get("flat")) and args.fail_on_edge:
        return 3  # no optimum bracketed: at an edge, or every point ties
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(PROG, build_parser(), run_screen, argv)


if __name__ == "__main__":
    sys.exit(main())
