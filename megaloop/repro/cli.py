"""``megaloop reproduce``: train every arm of one of the paper's experiments, evaluate, and report.

    megaloop reproduce --experiment tbptt --scale tiny --out runs/repro_tbptt
    megaloop reproduce --experiment my_arms.yaml --scale tiny --out runs/mine -- train.max_steps=50
    megaloop reproduce --experiment depth --scale M --launcher slurm --wait --out runs/repro_depth_M \\
        --sbatch-arg=--partition=gpu -- data.path=/data/txt360_mds data.val_path=/data/eval/val
    megaloop reproduce --render runs/repro_tbptt/results.json      # re-render report.md + PNGs
    megaloop reproduce --render runs/repro_tbptt/results.json --experiment tbptt   # + the file's claims now
    megaloop reproduce --render runs/a/results.json --merge runs/b/results.json --out runs/ab   # seeds of two runs

(``python tools/reproduce.py ...`` is the same command.) An experiment is a YAML of arms (name ->
a paper arm of megaloop/configs/arms.yaml and/or config overrides), scales and an evaluation plan
(megaloop/repro/spec.py documents the schema; shipped: megaloop/repro/experiments/*.yaml). Every
arm is validated before anything runs. Each arm is ``megaloop train --config <scale's preset>
--run-dir OUT/arms/<arm> --resume auto <overrides>``, then ``megaloop reproduce --evaluate-arm
<arm> --out OUT``: ``megaloop eval sweep`` (native PPL at every depth of the plan, terminal vs
per-visit PPL and the sharing penalty) and ``megaloop eval harness`` on its final checkpoint. The
arms run on megaloop/sweep.py (local process pool or one slurm array job). Overrides after ``--``
apply to every arm.

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
import signal
import sys
from pathlib import Path

from megaloop.errors import UserError
from megaloop.repro import report as rep
from megaloop.repro.evaluate import SUMMARY, check_eval_inputs, checkpoint_step, evaluate_arm
from megaloop.repro.merge import merge_results
from megaloop.repro.runs import (check_out, log, plan_sweep, resolve_lrs, run_dir, screen_point_done,
                                 screen_sweep, screened_groups, write_plan)
from megaloop.repro.spec import Plan, check_seeds, experiment_path, load_plan, shipped_experiments
from megaloop.runtime.files import nonempty_path
from megaloop.sweep import Run, add_launch_args, execute, launch_from_args, pending, run_cli, slurm_active
from megaloop.sweep_out import check_out_dir, check_out_kind, check_out_outside_data

PROG = "megaloop reproduce"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="Train, evaluate and report an experiment's arms.",
                                epilog=f"Shipped experiments: {', '.join(shipped_experiments())}. "
                                "Overrides for every arm go after --.")
    p.add_argument("--experiment", help="shipped experiment name or a YAML path")
    p.add_argument("--scale", default="tiny", help="scale of the experiment file (tiny, S, M, L, ...; default tiny)")
    p.add_argument("--out", type=nonempty_path, help="experiment directory (default runs/repro_<experiment>_<scale>)")
    p.add_argument("--arms", help="comma-separated subset of the arms to train/evaluate/report")
    p.add_argument("--seeds", help="comma-separated training seeds: every arm once per seed (replaces the file's "
                   "`seeds:`); cells become mean ± sd and verdicts use the spread")
    p.add_argument("--max-seqs", type=int, default=None, help="evaluation: validation sequences (plan's default)")
    p.add_argument("--depths", default=None, help="evaluation: comma-separated sweep depths (plan's default)")
    p.add_argument("--render", metavar="RESULTS_JSON", help="only re-render report.md and PNGs from a results.json "
                   "(with --experiment: take the claims and their verdict checks from that file)")
    p.add_argument("--merge", metavar="RESULTS_JSON", action="append", default=[],
                   help="with --render and --out: merge these results (other seeds of the same experiment) "
                   "with the --render one into OUT/results.json (megaloop/repro/merge.py); repeatable")
    p.add_argument("--evaluate-arm", metavar="ARM", help="only evaluate one trained arm of OUT/plan.json "
                   "(what each arm runs after its training)")
    add_launch_args(p, default_parallel="threads / threads-per-run")
    return p


def _eval_update(args: argparse.Namespace) -> dict:
    upd: dict = {}
    if args.max_seqs is not None:
        if args.max_seqs < 1:
            raise UserError(f"--max-seqs: must be >= 1, got {args.max_seqs}")
        upd["max_seqs"] = args.max_seqs
    if args.depths is not None:
        upd["depths"] = _ints(args.depths, "--depths")
        if not upd["depths"] or min(upd["depths"]) < 1:
            raise UserError(f"--depths: expected comma-separated integers >= 1, got {args.depths!r}")
    return upd


def _ints(text: str, flag: str) -> list[int]:
    """``"1,5,64"`` → integers; an empty entry (``5,,64``, a trailing comma) is refused, not dropped."""
    items = text.split(",")
    if text.strip() and not all(x.strip() for x in items):
        raise UserError(f"{flag}: expected comma-separated integers (no empty entries), got {text!r}")
    try:
        return [int(x) for x in items if x.strip()]
    except ValueError:
        raise UserError(f"{flag}: expected comma-separated integers, got {text!r}") from None


def _arms(args: argparse.Namespace) -> list[str] | None:
    if args.arms is None:
        return None
    only = [a.strip() for a in args.arms.split(",")]
    if not all(only):
        raise UserError(f"--arms: expected comma-separated arm names (no empty entries), got {args.arms!r}")
    if dup := sorted({a for a in only if only.count(a) > 1}):
        raise UserError(f"--arms: {dup[0]!r} is given twice")
    return only


def _seeds(args: argparse.Namespace) -> list[int] | None:
    if args.seeds is None:
        return None
    return check_seeds(_ints(args.seeds, "--seeds"), "--seeds")


def _read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"{what}: cannot read {path}: {err}") from None


def _read_results(path: Path, flag: str) -> dict:
    return rep.check_results(_read_json(path, flag), f"{flag}: {path}")


def render(args: argparse.Namespace) -> int:
    """``--render``: report.md and the PNGs from a results.json."""
    try:
        return _render(args)
    except (KeyError, TypeError, AttributeError, IndexError) as err:  # a field deeper than check_results looks
        files = ", ".join([args.render, *(args.merge or [])])
        raise UserError(f"--render: {files}: a results file this version cannot read (edited by hand, or written "
                        f"by another version?): {type(err).__name__}: {err}") from err


# flags of a run that --render does not read (it renders what the results file holds)
_NOT_FOR_RENDER = {"arms": "--arms", "seeds": "--seeds", "max_seqs": "--max-seqs", "depths": "--depths",
                   "evaluate_arm": "--evaluate-arm", "collect": "--collect", "dry_run": "--dry-run",
                   "wait": "--wait", "parallel": "--parallel", "threads": "--threads",
                   "threads_per_run": "--threads-per-run", "devices": "--devices", "poll": "--poll"}


def _render_out(args: argparse.Namespace, inputs: list[Path]) -> Path:
    """The folder --render writes into (``--out``, else the input's folder), refused when it holds
    another result that rendering (or merging) there would overwrite."""
    if args.out is None:
        return inputs[0].parent
    out = Path(args.out)
    check_out_kind(out, "reproduce")
    held = out / "results.json"
    if (out / "plan.json").is_file() and all(p.resolve().parent != out.resolve() for p in inputs):
        raise UserError(f"--out: {out} is an experiment folder (plan.json) that holds none of the inputs; rendering "
                        "there would overwrite its report; choose another folder")
    if held.is_file() and all(p.resolve() != held.resolve() for p in inputs):
        try:
            merged = bool(((json.loads(held.read_text()) or {}).get("launcher") or {}).get("merged"))
        except (OSError, ValueError, AttributeError):
            merged = False
        try:  # a render of the same input may replace its own earlier render (--experiment claims edited)
            again = not merged and len(inputs) == 1 and \
                (json.loads(held.read_text()) or {}).get("rendered_from") == str(inputs[0].resolve())
        except (OSError, ValueError, AttributeError):
            again = False
        if not (args.merge and merged) and not (again and not args.merge):  # a merge may replace an earlier merge
            raise UserError(f"--out: {out} holds another result ({held}) that this would overwrite; choose "
                            "another folder")
    return out


def _render(args: argparse.Namespace) -> int:
    given = [flag for key, flag in _NOT_FOR_RENDER.items() if getattr(args, key, None) not in (None, False)]
    if given or args.nproc != 1 or args.sbatch_arg or args.launcher != "local":
        flags = given + (["--nproc"] if args.nproc != 1 else []) + (["--sbatch-arg"] if args.sbatch_arg else []) \
            + (["--launcher"] if args.launcher != "local" else [])
        raise UserError(f"{flags[0]}: does not apply to --render, which renders what the results file holds "
                        "(run the experiment to train or evaluate)")
    path = Path(args.render)
    results = _read_results(path, "--render")
    if args.merge:
        if not args.out:
            raise UserError("--merge: needs --out, the folder of the merged result (the inputs stay as they are)")
        paths = [path, *map(Path, args.merge)]
        path = Path(args.out) / "results.json"
        if any(p.resolve() == path.resolve() for p in paths):
            raise UserError(f"--out: {args.out} holds one of the merged files; choose a new folder")
        out = _render_out(args, paths)
        results = rep.add_verdicts(merge_results(paths, [results, *(_read_results(p, "--merge") for p in paths[1:])],
                                                 out))
        results.pop("rendered_from", None)  # a merge is no copy of its first input
    else:
        out = _render_out(args, [path])
    if args.experiment:  # the claims (and their verdict checks) of the experiment file as it is now
        plan = load_plan(args.experiment, results["scale"])
        held = {a.get("group") or a["name"] for a in results["arms"]}
        if unknown := sorted(held - set(plan.groups())):  # another experiment: its claims would replace these
            raise UserError(f"--experiment: {args.experiment} (experiment {plan.experiment!r}) has no arm "
                            f"{', '.join(unknown)} of {path} (experiment {results.get('experiment')!r}); "
                            "--render --experiment re-reads the claims of the results' own experiment file "
                            "(or an edited copy of it)")
        claims = [c for c in plan.claims if set(c.arms + ([c.relative_to] if c.relative_to else [])) <= held]
        if dropped := list(dict.fromkeys(c.id for c in plan.claims if c not in claims)):  # as --arms does
            log(f"claims {', '.join(dropped)} of {args.experiment} left out: {path} does not hold their arms")
        results["claims"] = [c.__dict__ for c in claims]
        rep.add_verdicts(results)
    outputs = rep.render(results, out)  # all or nothing
    written = []
    # the results file goes with its report: into --out (the input is left as it is) or, without
    # --out, back into the input's results.json with the experiment file's claims
    if args.merge or (args.experiment and (args.out is not None or path.name == "results.json")):
        if not args.merge and out.resolve() != path.resolve().parent:  # a copy: says which file it renders
            results["rendered_from"] = str(path.resolve())
        written = [rep.write_results(out, results)]
    rep.print_table(results)
    print("  wrote " + ", ".join(map(str, [*written, *outputs])))
    return 0


def evaluate_one(args: argparse.Namespace) -> int:
    """``--evaluate-arm``: evaluate one arm of OUT/plan.json once it is trained to the end."""
    if not args.out:
        raise UserError("--evaluate-arm: needs --out (the experiment directory holding plan.json)")
    out = Path(args.out)
    try:
        plan = Plan.from_dict(_read_json(out / "plan.json", "--evaluate-arm"))
        arm = plan.arm(args.evaluate_arm)
    except (KeyError, TypeError) as err:
        raise UserError(f"--evaluate-arm: no arm {args.evaluate_arm!r} in {out / 'plan.json'} ({err!r})") from None
    rd, max_steps = run_dir(out, arm), plan.settings["max_steps"]
    step = checkpoint_step(rd)
    if step is None or step < max_steps:
        log(f"{arm.name}: trained to step {step} of {max_steps}: nothing to evaluate yet")
        return 0

    def on_term(_signum, _frame):  # noqa: ANN001  (the stage subprocess is killed on the way out)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    s = evaluate_arm(rd, arm, plan.eval, max_steps=max_steps, threads=args.threads_per_run, log=log)
    return 0 if s["complete"] else 1


def _data_paths(plan: Plan) -> dict[str, str | None]:
    """The datasets an experiment reads (training and validation data of its arms, which share
    them, the evaluation set and the LR-screen set), by the field that names each."""
    from megaloop.config import load_config

    paths = {"eval.data": plan.eval.data, "eval.synth": plan.eval.synth}
    for arm in plan.arms:  # every arm trains on one data.path (load_plan checks); each has its val_path
        cfg = load_config(plan.config, arm.overrides)  # validated once already by load_plan
        paths.setdefault("data.path", cfg.data.path)
        paths.setdefault(f"data.val_path (arm {arm.name})", cfg.data.val_path)
    if plan.screen is not None:
        paths["screen.screen_set"] = plan.screen.screen_set
    return paths


def run_experiment(args: argparse.Namespace, extras: list[str]) -> int:
    """The experiment: launch the unfinished arms, then collect, render and report."""
    if args.merge and not args.render:
        raise UserError("--merge: goes with --render (the first results.json) and --out")
    if args.render or args.evaluate_arm:  # they write into --out at once: probe it here (run_cli checked its shape)
        check_out_dir(args.out)
    if args.render:
        return render(args)
    if args.evaluate_arm:
        return evaluate_one(args)
    if not args.experiment:
        raise UserError("--experiment: required (a shipped name or a YAML path), or --render")
    launch = launch_from_args(args, default_parallel=None)
    only = _arms(args)
    base = load_plan(args.experiment, args.scale, extras, _eval_update(args), only, seeds=_seeds(args))
    check_eval_inputs(base.eval, str(experiment_path(args.experiment)), files=not launch.dry_run)
    out = Path(args.out or f"runs/repro_{base.experiment}_{base.scale}").resolve()
    if not args.out:  # run_cli checked an explicit --out's shape; the default is checked here
        check_out_dir(str(out), probe=False)
    check_out_kind(out, "reproduce")
    check_out_outside_data(out, _data_paths(base))
    check_out_dir(str(out), probe=not launch.dry_run)  # after: inside a read-only dataset is named as such
    if launch.collect and not ((out / "plan.json").is_file() or (out / "arms").is_dir()):  # as lr-screen's
        raise UserError(f"--collect: {out} holds no experiment (no plan.json, no arms/); nothing to collect")
    plan, screens, waiting = resolve_lrs(out, base)
    check_out(out, plan, skip=waiting)
    if launch.collect:
        _check_collect_eval_plan(out, plan)
    s = plan.settings
    log(f"experiment {plan.experiment} ({Path(plan.source).name}) at scale {plan.scale}: {len(plan.groups())} "
        f"arm(s)" + (f" x {len(plan.seeds)} seeds {plan.seeds}" if plan.seeds else "") + f", preset {plan.config}, "
        f"{s['max_steps']} steps x {s['tokens_per_step']:,} tokens, seed {s['seed']}"
        + (f"; {plan.note}" if plan.note else ""))
    if plan.screen is not None:
        sp = plan.screen
        log(f"LR screens of {', '.join(screened_groups(plan))}: grid {sp.grid}, stop after {sp.stop_after} of "
            f"{s['max_steps']} updates, val CE at R={sp.eval_depth} on {sp.screen_set}")
    if not args.dry_run:
        out.mkdir(parents=True, exist_ok=True)
        write_plan(out, plan)
    code, active = 0, {}
    if plan.screen is not None:  # the screens first: the arms that wait for them start after
        sweep = screen_sweep(out, plan)
        active = slurm_active(sweep) if launch.launcher == "slurm" and not args.dry_run else {}
        code, active = execute(sweep, pending(sweep, active, lambda r: screen_point_done(out, plan, r)), launch,
                               active)
        if waiting and not args.dry_run and not code:
            plan, screens, still = resolve_lrs(out, base)
            check_out(out, plan, skip=still)
            write_plan(out, plan)
            waiting = still
    for name in waiting:
        sc = screens.get(plan.arm(name).lr_source) or {}
        log(f"{name}: waiting for its LR screen" + (" (dry run: its rate is not known yet)" if args.dry_run else
                                                    f": every point of its screen diverged; extend the grid below "
                                                    f"in the experiment file (proposed {sc.get('proposed_grid')})"
                                                    if sc.get("all_diverged") else
                                                    ": rerun this command when the screen's runs are done"))
    if not code:
        sweep, states = plan_sweep(out, plan, skip=waiting)
        more = slurm_active(sweep) if launch.launcher == "slurm" and not args.dry_run else {}

        def finished(run: Run) -> str | None:
            st = states[run.name]
            if st["status"] == "done":
                return f"done (step {st['step']}, evaluated)"
            if st["status"] != "pending" and run.name not in more:
                where = f"at step {st['step']}" if st["step"] is not None else "before its first checkpoint"
                log(f"{run.name}: {st['status']} {where}: " + ("resume" if run.train else "evaluate"))
            return None

        code, more = execute(sweep, pending(sweep, more, finished), launch, more)
        active = {**active, **more}
    if args.dry_run:
        return 0
    where = (f"{launch.parallel} run(s) in parallel x {launch.threads} thread(s)"
             + (f" x {launch.nproc} proc(s)" if launch.nproc > 1 else "")) if launch.launcher == "local" \
        else " ".join(launch.sbatch_args) or "default sbatch options"
    held_seeds = _held_seeds(out, plan)
    if only is not None or held_seeds:  # the report covers every arm and seed this OUT holds, not only those run now
        seeds = sorted(set(plan.seeds) | set(held_seeds)) if held_seeds else _seeds(args)
        plan, screens, waiting = resolve_lrs(out, _held_arms_plan(out, args, extras, only, seeds))
    results = rep.collect(out, plan, active, {launch.launcher: where}, screens=screens, waiting=waiting)
    # results.json and the report as one: a stop signal waits until both are written (a SIGTERM between
    # them left results.json newer than report.md)
    from megaloop.runtime.exits import STOP_SIGNALS_UNHANDLED_BY_HELPERS, start_shielded

    path, outputs = start_shielded(lambda: (rep.write_results(out, results), rep.render(results, out)),
                                   ("SIGINT", "SIGTERM", *STOP_SIGNALS_UNHANDLED_BY_HELPERS))
    rep.print_table(results)
    print(f"  wrote {path}, " + ", ".join(map(str, outputs)))
    if code:
        return code
    return 1 if any(a["status"] not in ("done", "queued") for a in results["arms"]) else 0


def _check_collect_eval_plan(out: Path, plan: Plan) -> None:
    """--collect with another evaluation plan (--depths/--max-seqs) than the arms were evaluated
    with would report none of their measurements: refused, naming the arm and the plans."""
    for arm in plan.arms:
        path = run_dir(out, arm) / "eval" / SUMMARY
        try:
            summary = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if summary.get("complete") and summary.get("eval_digest") != plan.eval.digest():
            raise UserError(f"--collect: arm {arm.name!r} was evaluated with another plan than this command's "
                            f"(--depths/--max-seqs or the file's eval:; {path}); collect with the same plan, or "
                            "run without --collect to evaluate every arm again with this one")


def _plan_json_arms(out: Path) -> list[dict]:
    try:
        arms = json.loads((out / "plan.json").read_text()).get("arms", [])
        return [a for a in arms if isinstance(a, dict) and "name" in a]
    except (OSError, ValueError, AttributeError):
        return []


def _held_seeds(out: Path, plan: Plan) -> list[int]:
    """Seeds of this experiment that ``OUT/plan.json`` records beyond the command's own (a rerun with
    ``--seeds 2`` into a ``--seeds 0,1`` folder rewrote results.json and the report with seed 2 alone);
    [] when there are none or the runs are not seeded."""
    if not plan.seeds:
        return []
    held = {a.get("seed") for a in _plan_json_arms(out)} - {None} - set(plan.seeds)
    return sorted(s for s in held if isinstance(s, int))


def _held_arms_plan(out: Path, args: argparse.Namespace, extras: list[str], only: list[str] | None,
                    seeds: list[int] | None) -> Plan:
    """The experiment restricted to ``only`` (None: every arm) and every run of it that ``OUT/plan.json``
    records, at ``seeds`` (None: the file's)."""
    every = load_plan(args.experiment, args.scale, extras, _eval_update(args), None, seeds=seeds)
    if only is None:
        return every
    known = {a.name for a in every.arms}
    held = {a["name"] for a in _plan_json_arms(out)}
    return load_plan(args.experiment, args.scale, extras, _eval_update(args), sorted(set(only) | (held & known)),
                     seeds=seeds)


def main(argv: list[str] | None = None) -> int:
    return run_cli(PROG, build_parser(), run_experiment, argv)


if __name__ == "__main__":
    sys.exit(main())
