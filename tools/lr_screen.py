#!/usr/bin/env python
"""Learning-rate screens (SPEC §11): one short run per LR of a log-spaced grid, select by the
validation CE at depth R=5 on the frozen LR-screen set, and check the optimum is bracketed.

    python tools/lr_screen.py --config S --out runs/screen_S                      # paper range, 7 points
    python tools/lr_screen.py --config tiny --grid 1e-3,3e-3,1e-2 --out runs/scr --stop-after 20
    python tools/lr_screen.py --config L --launcher slurm --wait --screen-set /data/eval/screen \\
        --out runs/screen_L -- data.path=/data/txt360_mds

Each point is ``megaloop train --config C --run-dir OUT/lr_<lr> --resume auto optim.lr=<lr>
train.stop_after=<N> data.val_path=<screen set> train.eval_depth=5 train.eval_batches=<K> ...``:
the config's full ``train.max_steps`` horizon (so the WSD schedule of the full run) is kept and the
run stops after N updates; its last metrics line carries ``val_ce`` at depth 5 on the screen set.

Outputs in OUT: ``results.csv``, ``results.json``, ``screen.png`` (CE vs LR, log x, best marked),
``screen.json`` (the screen's fixed settings), ``launches.jsonl`` (one line per training launch),
``lr_<lr>/`` run directories (``train.log``, ``metrics.jsonl``, ``checkpoints/``, ``screen_exit``).

Resumable: rerunning the same command skips finished points (final step logged with ``val_ce``),
resumes unfinished ones from their latest checkpoint, and keeps diverged ones. A grid extended by a
point reuses every finished run in OUT (the run directories are keyed by LR).

Exit status: 0 screen complete (an edge optimum is reported loudly but is not an error unless
``--fail-on-edge``: 3); 1 some point failed or is unfinished; 2 bad arguments / config.
"""

import argparse
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# the library lives in megaloop/screen/; the names below are also this script's API
from megaloop.screen.core import (  # noqa: E402
    TERMINAL,
    UsageError,
    SCALE_DEFAULTS,
    WHOLE_SET,
    _finite,
    build_screen,
    check_fixed_settings,
    log,
    log_grid,  # noqa: F401  (API used by tests and users)
    lr_tag,
    parse_grid,  # noqa: F401
    point_state,
    scale_of,  # noqa: F401
    select_best,
    write_json,
)
from megaloop.screen.launch import (  # noqa: E402
    compress_indices,  # noqa: F401
    local_command,
    run_local,
    run_slurm,
    slurm_active,
    slurm_jobs,
    wait_slurm,
)
from megaloop.screen.report import collect, plot, proposal_command, report, write_results  # noqa: E402


# ====================================================================================== main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lr_screen.py",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Learning-rate screen (SPEC §11): short runs over a log-spaced LR grid, selected "
        "by validation CE at R=5 on the frozen screen set.",
        epilog="Per-scale defaults (used when --grid/--range/--stop-after are not given):\n"
        + "\n".join(
            f"  {k:<5} range [{v['range'][0]:g}, {v['range'][1]:g}], {v['points']} points, stop after {v['stop_after']}"
            for k, v in SCALE_DEFAULTS.items()
        )
        + "\n  (untied4/untied12 use S's)\nExtra dotlist overrides for every run go after --.",
    )
    p.add_argument("--config", required=True, help="preset (tiny, S, M, L, untied4, untied12) or YAML path")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--grid", help="comma-separated learning rates, e.g. 5e-4,1e-3,2e-3")
    g.add_argument("--range", help="LO,HI: log-spaced grid of --points values from LO to HI")
    p.add_argument("--points", type=int, help="number of grid points for --range (>= 3)")
    p.add_argument("--out", required=True, help="screen directory (run dirs, results.csv/json, screen.png)")
    p.add_argument("--launcher", choices=("local", "slurm"), default="local")
    p.add_argument("--stop-after", type=int, help="updates per screen run (absolute step count)")
    p.add_argument(
        "--screen-set",
        help="MDS LR-screen set (default: the embedded corpus's "
        "'default:screen' when data.path is the embedded default; required otherwise)",
    )
    p.add_argument("--eval-depth", type=int, default=5, help="recurrence depth of the selection CE (5)")
    p.add_argument("--eval-batches", type=int, help="eval micro-batches (default: the whole screen set)")
    p.add_argument(
        "--parallel", type=int, help="local: runs at a time (default 1); slurm: array throttle %%K (default none)"
    )
    p.add_argument("--nproc", type=int, default=1, help="local: processes per run (torchrun --standalone)")
    p.add_argument("--devices", help="local: comma-separated CUDA devices split among parallel runs")
    p.add_argument(
        "--sbatch-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="slurm: extra sbatch argument, repeatable (e.g. --sbatch-arg=--partition=gpu)",
    )
    p.add_argument("--wait", action="store_true", help="slurm: poll squeue until the array finishes, then report")
    p.add_argument("--poll", type=float, default=60.0, help="slurm --wait: seconds between squeue polls")
    p.add_argument("--collect", action="store_true", help="launch nothing: collect, plot and report")
    p.add_argument("--dry-run", action="store_true", help="print what would run; write nothing")
    p.add_argument("--fail-on-edge", action="store_true", help="exit 3 when the best LR is on a grid edge")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extras: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extras = argv[:cut], argv[cut + 1 :]
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        screen = build_screen(args, extras)
        if not args.dry_run:
            check_fixed_settings(screen)
    except UsageError as err:
        print(f"lr_screen.py: error: {err}", file=sys.stderr)
        return 2

    log(
        f"config {screen.config}: {len(screen.lrs)} points {[lr_tag(x) for x in screen.lrs]}, "
        f"stop after {screen.end_step} of {screen.max_steps} updates, val CE at R={screen.eval_depth} on "
        f"{screen.screen_set} ({'whole set' if screen.eval_batches == WHOLE_SET else f'{screen.eval_batches} micro-batches'})"
    )
    if screen.end_step <= screen.warmup_steps:
        log(
            f"warning: the screen stops at step {screen.end_step}, inside the LR warm-up "
            f"(optim.warmup_steps={screen.warmup_steps}): no run reaches its peak LR"
        )

    if not args.dry_run:
        screen.out.mkdir(parents=True, exist_ok=True)
        write_json(
            screen.out / "screen.json", {**screen.fixed(), "grid": screen.lrs, "screen_set_info": screen.screen_info}
        )
    try:
        active = slurm_active(screen) if (args.launcher == "slurm" and not args.dry_run and slurm_jobs(screen)) else {}
    except UsageError as err:
        print(f"lr_screen.py: error: {err}", file=sys.stderr)
        return 2
    todo = []
    for lr in screen.lrs:
        st = point_state(screen.run_dir(lr), screen.end_step)
        if st["status"] in TERMINAL:
            ce = f", val_ce={st['val_ce']:.4f}" if _finite(st["val_ce"]) else ""
            log(f"skip lr={lr_tag(lr)}: {st['status']} (step {st['steps']}{ce})")
        elif lr in active:
            log(f"skip lr={lr_tag(lr)}: still queued/running in slurm job {active[lr]}")
        else:
            todo.append(lr)

    code = 0
    if args.collect:
        pass
    elif args.dry_run:
        if args.launcher == "local":
            for lr in todo:
                log(f"would run: {shlex.join(local_command(screen, lr, args.nproc))}")
        else:
            try:
                run_slurm(screen, todo, args.parallel, args.sbatch_arg, dry_run=True)
            except UsageError as err:
                print(f"lr_screen.py: error: {err}", file=sys.stderr)
                return 2
        return 0
    elif args.launcher == "local":
        devices = [d.strip() for d in args.devices.split(",") if d.strip()] if args.devices else None
        try:
            if todo:
                run_local(screen, todo, args.parallel or 1, args.nproc, devices)
        except UsageError as err:
            print(f"lr_screen.py: error: {err}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            code = 130
    else:
        try:
            job = run_slurm(screen, todo, args.parallel, args.sbatch_arg, dry_run=False) if todo else None
            if args.wait:
                for j in ([job] if job else []) + sorted(set(active.values())):
                    wait_slurm(j, args.poll)
                active = {}
            elif job or active:
                active = {**slurm_active(screen), **{lr: job for lr in todo if job}}
                log(
                    "not waiting (--wait not given): rerun this command, or add --collect, to collect "
                    "results when the jobs are done"
                )
        except UsageError as err:
            print(f"lr_screen.py: error: {err}", file=sys.stderr)
            return 2
        except RuntimeError as err:
            print(f"lr_screen.py: error: {err}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            log("stopped waiting; the slurm jobs keep running (rerun to collect)")
            code = 130

    points = collect(screen, active)
    sel = select_best(points)
    proposal = proposal_command(args, screen, sel["proposed_grid"]) if sel["proposed_grid"] else None
    write_results(screen, points, sel, proposal)
    png = plot(screen, points, sel, screen.out / "screen.png")
    report(screen, points, sel, proposal)
    print(f"  results: {screen.out / 'results.csv'}, {screen.out / 'results.json'}" + (f", {png}" if png else ""))
    if code:
        return code
    if any(p["status"] in ("failed", "interrupted", "partial", "pending") for p in points):
        return 1  # "queued" (still in slurm) is not a failure
    if sel["edge"] and args.fail_on_edge:
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
