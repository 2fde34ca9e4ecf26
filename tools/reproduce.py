#!/usr/bin/env python
"""Reproduce the paper's experiments: train every arm of an experiment, evaluate, and report.

    python tools/reproduce.py --experiment tbptt --scale tiny --out runs/repro_tbptt
    python tools/reproduce.py --experiment my_arms.yaml --scale tiny --out runs/mine -- train.max_steps=50
    python tools/reproduce.py --experiment depth --scale M --launcher slurm --wait --out runs/repro_depth_M \\
        --sbatch-arg=--partition=gpu -- data.path=/data/txt360_mds data.val_path=/data/eval/val
    python tools/reproduce.py --render runs/repro_tbptt/results.json      # re-render report.md + PNGs

An experiment is a YAML of arms (name -> config overrides), scales and an evaluation plan
(megaloop/repro/spec.py documents the schema; shipped: megaloop/repro/experiments/*.yaml).
Every arm is validated before anything runs. Each arm is ``megaloop train --config <scale's
preset> --run-dir OUT/arms/<arm> --resume auto <overrides>``, then ``megaloop eval sweep``
(native PPL at every depth of the plan, terminal vs per-visit PPL and the sharing penalty) and
``megaloop eval harness`` on its final checkpoint. Overrides after ``--`` apply to every arm.

Outputs in OUT: ``results.json``, ``report.md`` (the paper-layout table, the SPEC §12 claims
beside the measured figures, run details), ``ppl_vs_depth.png``, ``prior_evolution.png``,
``training_curves.png``, ``plan.json``, ``launches.jsonl``, ``arms/<arm>/``.

Rerunning the same command skips finished arms (trained to train.max_steps and evaluated with
the same plan), resumes unfinished ones from their latest checkpoint and evaluates trained ones.
Exit status: 0 every arm done; 1 some arm unfinished or failed; 2 bad arguments / experiment file;
130 interrupted (running trainings were checkpointed).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from megaloop.config_utils import ConfigError  # noqa: E402
from megaloop.repro import report as rep  # noqa: E402
from megaloop.repro.runner import (LocalRunner, arm_state, check_identity, log, slurm_active,  # noqa: E402
                                   submit_slurm, train_command, wait_slurm, write_json)
from megaloop.repro.spec import Plan, SpecError, load_plan, shipped_experiments  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="reproduce.py", formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="Train, evaluate and report an experiment's arms.",
                                epilog=f"Shipped experiments: {', '.join(shipped_experiments())}. "
                                "Overrides for every arm go after --.")
    p.add_argument("--experiment", help="shipped experiment name or a YAML path")
    p.add_argument("--scale", default="tiny", help="scale of the experiment file (tiny, S, M, L, ...; default tiny)")
    p.add_argument("--out", help="experiment directory (default runs/repro_<experiment>_<scale>)")
    p.add_argument("--launcher", choices=("local", "slurm"), default="local")
    p.add_argument("--threads", type=int, default=None,
                   help="local: total CPU thread budget (default: all CPUs of this machine)")
    p.add_argument("--threads-per-arm", type=int, default=1, help="local: torch threads of each arm (default 1)")
    p.add_argument("--parallel", type=int, default=None,
                   help="local: arms at a time (default threads / threads-per-arm); slurm: array throttle %%K")
    p.add_argument("--nproc", type=int, default=1, help="local: processes per arm (torchrun --standalone)")
    p.add_argument("--devices", help="local: comma-separated CUDA devices, --nproc per arm")
    p.add_argument("--arms", help="comma-separated subset of the arms to train/evaluate/report")
    p.add_argument("--max-seqs", type=int, default=None, help="evaluation: validation sequences (plan's default)")
    p.add_argument("--depths", default=None, help="evaluation: comma-separated sweep depths (plan's default)")
    p.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                   help="slurm: extra sbatch argument, repeatable (e.g. --sbatch-arg=--partition=gpu)")
    p.add_argument("--wait", action="store_true", help="slurm: poll squeue until the array finishes, then report")
    p.add_argument("--poll", type=float, default=60.0, help="slurm --wait: seconds between squeue polls")
    p.add_argument("--collect", action="store_true", help="launch nothing: collect and report")
    p.add_argument("--dry-run", action="store_true", help="validate and print what would run; write nothing")
    p.add_argument("--render", metavar="RESULTS_JSON", help="only re-render report.md and PNGs from a results.json")
    return p


def _eval_update(args: argparse.Namespace) -> dict:
    upd: dict = {}
    if args.max_seqs is not None:
        if args.max_seqs < 1:
            raise ConfigError(f"--max-seqs: must be >= 1, got {args.max_seqs}")
        upd["max_seqs"] = args.max_seqs
    if args.depths is not None:
        try:
            upd["depths"] = [int(x) for x in args.depths.split(",") if x.strip()]
        except ValueError:
            raise ConfigError(f"--depths: expected comma-separated integers, got {args.depths!r}") from None
    return upd


def _check_out(out: Path, plan: Plan) -> None:
    path = out / "plan.json"
    if not path.is_file():
        return
    try:
        old = json.loads(path.read_text())
    except ValueError:
        return
    if (old.get("experiment"), old.get("scale")) != (plan.experiment, plan.scale):
        raise SpecError(f"--out: {out} holds experiment {old.get('experiment')!r} at scale {old.get('scale')!r}, "
                        f"not {plan.experiment!r} at {plan.scale!r}; use another --out")
    for arm in plan.arms:
        check_identity(out, plan, arm)


def _plan_json(out: Path, plan: Plan) -> None:
    """plan.json keeps every arm ever run in OUT (a later --arms subset must not drop the others)."""
    path = out / "plan.json"
    d = plan.to_dict()
    if path.is_file():
        try:
            old = json.loads(path.read_text())
            names = {a["name"] for a in d["arms"]}
            d["arms"] = [a for a in old.get("arms", []) if a["name"] not in names] + d["arms"]
        except (ValueError, KeyError):
            pass
    write_json(path, d)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extras: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extras = argv[:cut], argv[cut + 1:]
    args = build_parser().parse_args(argv)
    try:
        if args.render:
            path = Path(args.render)
            try:
                results = json.loads(path.read_text())
            except (OSError, ValueError) as err:
                raise ConfigError(f"--render: cannot read {path}: {err}") from None
            outputs = rep.render(results, Path(args.out) if args.out else path.parent)
            rep.print_table(results)
            print("  wrote " + ", ".join(map(str, outputs)))
            return 0
        if not args.experiment:
            raise ConfigError("--experiment: required (a shipped name or a YAML path), or --render")
        for name in ("threads", "threads_per_arm", "nproc"):
            v = getattr(args, name)
            if v is not None and v < 1:
                raise ConfigError(f"--{name.replace('_', '-')}: must be >= 1, got {v}")
        if args.parallel is not None and args.parallel < 1:
            raise ConfigError(f"--parallel: must be >= 1, got {args.parallel}")
        only = [a.strip() for a in args.arms.split(",") if a.strip()] if args.arms else None
        plan = load_plan(args.experiment, args.scale, extras, _eval_update(args), only)
        out = Path(args.out or f"runs/repro_{plan.experiment}_{plan.scale}").resolve()
        _check_out(out, plan)
    except ConfigError as err:  # SpecError included
        print(f"reproduce.py: error: {err}", file=sys.stderr)
        return 2

    threads = args.threads or os.cpu_count() or 1
    parallel = args.parallel or max(1, threads // args.threads_per_arm)
    devices = [d.strip() for d in args.devices.split(",") if d.strip()] if args.devices else None
    if devices and args.parallel is None:
        parallel = max(1, len(devices) // args.nproc)
    s = plan.settings
    log(f"experiment {plan.experiment} ({Path(plan.source).name}) at scale {plan.scale}: {len(plan.arms)} arm(s), "
        f"preset {plan.config}, {s['max_steps']} steps x {s['tokens_per_step']:,} tokens, seed {s['seed']}"
        + (f"; {plan.note}" if plan.note else ""))
    launcher = ({"local": f"{parallel} arm(s) in parallel x {args.threads_per_arm} thread(s)"
                 + (f" x {args.nproc} proc(s)" if args.nproc > 1 else "")} if args.launcher == "local"
                else {"slurm": " ".join(args.sbatch_arg) or "default sbatch options"})
    if not args.dry_run:
        out.mkdir(parents=True, exist_ok=True)
        _plan_json(out, plan)
    try:
        active = slurm_active(out) if args.launcher == "slurm" and not args.dry_run else {}
    except ConfigError as err:
        print(f"reproduce.py: error: {err}", file=sys.stderr)
        return 2
    todo = []
    for arm in plan.arms:
        st = arm_state(out, plan, arm)
        if st["status"] == "done":
            log(f"skip {arm.name}: done (step {st['step']}, evaluated)")
        elif arm.name in active:
            log(f"skip {arm.name}: still queued/running in slurm job {active[arm.name]}")
        else:
            todo.append(arm)
            if st["status"] != "pending":
                log(f"{arm.name}: {st['status']} at step {st['step']}: "
                    + ("evaluate" if st["status"] == "trained" else "resume"))

    code = 0
    if args.dry_run:
        if args.launcher == "local":
            for arm in todo:
                log(f"would run: {shlex.join(train_command(out, plan, arm, args.nproc))}")
        else:
            try:
                submit_slurm(out, plan, todo, args.parallel, args.sbatch_arg, dry_run=True)
            except ConfigError as err:
                print(f"reproduce.py: error: {err}", file=sys.stderr)
                return 2
        return 0
    if not args.collect and todo:
        try:
            if args.launcher == "local":
                LocalRunner(out, plan, parallel=parallel, threads=args.threads_per_arm, nproc=args.nproc,
                            devices=devices).run(todo)
            else:
                job = submit_slurm(out, plan, todo, args.parallel, args.sbatch_arg)
                active.update({a.name: job for a in todo if job})
        except ConfigError as err:
            print(f"reproduce.py: error: {err}", file=sys.stderr)
            return 2
        except RuntimeError as err:
            print(f"reproduce.py: error: {err}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            code = 130
    if args.launcher == "slurm" and args.wait and not code:
        try:
            wait_slurm(out, args.poll)
            active = {}
        except KeyboardInterrupt:
            log("stopped waiting; the slurm jobs keep running (rerun to collect)")
            code = 130
    elif args.launcher == "slurm" and active:
        log("not waiting (--wait not given): rerun this command, or add --collect, when the jobs are done")

    results = rep.collect(out, plan, active, launcher)
    path = rep.write_results(out, results)
    outputs = rep.render(results, out)
    rep.print_table(results)
    print(f"  wrote {path}, " + ", ".join(map(str, outputs)))
    if code:
        return code
    if any(a["status"] not in ("done", "queued") for a in results["arms"]):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
