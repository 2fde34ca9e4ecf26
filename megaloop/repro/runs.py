"""An experiment's arms on disk: run directories, state (skip / resume / evaluate), identity, and
the experiment as a plan of runs on megaloop/sweep.py.

Layout of an experiment directory ``OUT``: ``plan.json`` (the resolved experiment: every arm ever
run in OUT), ``arms/<arm>/`` (one megaloop run directory per arm: ``train.log``, ``metrics.jsonl``,
``checkpoints/``, ``sweep_run.json`` = how it was last launched, ``repro_exit`` = the last training
exit status, ``eval/`` and ``after.log`` = its evaluation), ``launches.jsonl`` and, for slurm,
``slurm/``. Each arm trains, then runs ``megaloop reproduce --evaluate-arm ARM --out OUT``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megaloop.config_utils import dotlist_settings
from megaloop.repro.evaluate import checkpoint_step, eval_done
from megaloop.repro.spec import Arm, Plan, SpecError, identity_overrides
from megaloop.runtime.files import atomic_write_json
from megaloop.sweep import Run, Sweep, read_exit, started_with, stopped, trained_model_differences

TAG = "reproduce"  # log prefix
EXIT_FILE = "repro_exit"  # RUN_DIR/repro_exit: the last training exit status


def log(msg: str) -> None:
    print(f"[{TAG}] {msg}", flush=True)


def run_dir(out: Path, arm: Arm | str) -> Path:
    return Path(out) / "arms" / (arm if isinstance(arm, str) else arm.name)


def arm_state(out: Path, plan: Plan, arm: Arm) -> dict:
    """``{status, step, exit_code}``; status is one of

    done (trained to train.max_steps and evaluated with this plan), trained (evaluation missing,
    failed or stale), partial (a checkpoint before the last step: resumed next time), failed (the
    last training exited with an error before finishing), interrupted (stopped by a signal),
    pending (never started).
    """
    rd = run_dir(out, arm)
    st: dict[str, Any] = {"status": "pending", "step": None, "exit_code": None}
    if not rd.exists():
        return st
    step = st["step"] = checkpoint_step(rd)
    code = st["exit_code"] = read_exit(rd, EXIT_FILE)
    if step is not None and step >= plan.settings["max_steps"]:
        st["status"] = "done" if eval_done(rd, plan.eval, step) else "trained"
    elif stopped(code):
        st["status"] = "interrupted"
    elif code not in (None, 0):
        st["status"] = "failed"
    elif step is not None or (rd / "metrics.jsonl").is_file():
        st["status"] = "partial"
    return st


def identity_settings(overrides: list[str]) -> dict[str, str | None]:
    """The settings an arm's overrides make, as ``{key: last value}`` (run-control keys dropped): the
    same overrides in another order are the same settings (as ``megaloop lr-screen`` compares them)."""
    return dotlist_settings(identity_overrides(overrides))


def identity_differences(old: dict, config: str, overrides: list[str]) -> list[str]:
    """What differs between how an arm was started (``old``: its ``sweep_run.json``) and ``config`` +
    ``overrides``, one ``now (was before)`` item per config or setting; empty: the same."""
    diff = [] if old.get("config") == config else [f"config {config} (was {old.get('config')})"]
    theirs, mine = identity_settings(old.get("overrides") or []), identity_settings(overrides)

    def shown(key: str, d: dict) -> str:
        return "unset" if key not in d else key if d[key] is None else f"{key}={d[key]}"

    for key in sorted(set(theirs) | set(mine)):
        if theirs.get(key, ...) != mine.get(key, ...):
            now = shown(key, mine)
            diff.append(f"{key} unset (was {shown(key, theirs)})" if now == "unset"
                        else f"{now} (was {shown(key, theirs)})")
    return diff


def check_identity(out: Path, plan: Plan, arm: Arm) -> None:
    """An arm directory may only be resumed with the config and overrides it was started with
    (run-control keys aside: ``spec.IDENTITY_IGNORED``); overrides compare as the settings they make,
    in any order."""
    old = started_with(run_dir(out, arm))
    if old is None:
        return
    if changed := identity_differences(old, plan.config, arm.overrides):
        raise SpecError(f"--out: arm {arm.name!r} in {run_dir(out, arm)} was started with other settings "
                        f"(differs in: {'; '.join(changed)}); use a new --out or the same experiment/scale/overrides")
    if what := trained_model_differences(run_dir(out, arm), plan.config, arm.overrides):  # a default changed
        raise SpecError(f"--out: arm {arm.name!r} in {run_dir(out, arm)} trained another model than these "
                        f"settings give with today's defaults ({what}); use a new --out")


def check_out(out: Path, plan: Plan, skip: list[str] = ()) -> None:
    """OUT holds this experiment at this scale (or nothing), and no arm started differently
    (``skip``: runs whose overrides are not complete yet, i.e. waiting for an LR screen)."""
    path = out / "plan.json"
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if (old.get("experiment"), old.get("scale")) != (plan.experiment, plan.scale):
        raise SpecError(f"--out: {out} holds experiment {old.get('experiment')!r} at scale {old.get('scale')!r}, "
                        f"not {plan.experiment!r} at {plan.scale!r}; use another --out")
    if "seeds" in old and (old["seeds"] is None) != (plan.seeds is None):
        seeds = sorted({a["seed"] for a in old.get("arms", []) if isinstance(a.get("seed"), int)})
        held = "one run per arm without --seeds" if old["seeds"] is None else f"runs at --seeds {seeds}"
        again = f"give --seeds {','.join(map(str, seeds))} to continue them, or " if seeds else ""
        raise SpecError(f"--out: {out} holds {held}; runs {'with' if plan.seeds is not None else 'without'} "
                        "--seeds cannot join them (an arm would be trained twice under two names and each report "
                        f"would drop the others): {again}use another --out and combine the two with "
                        "--render A --merge B")
    for arm in plan.arms:
        if arm.name not in skip:
            check_identity(out, plan, arm)


def write_plan(out: Path, plan: Plan) -> None:
    """plan.json keeps every arm ever run in OUT (a later --arms subset must not drop the others)."""
    path = out / "plan.json"
    d = plan.to_dict()
    try:
        names = {a["name"] for a in d["arms"]}
        d["arms"] = [a for a in json.loads(path.read_text()).get("arms", []) if a["name"] not in names] + d["arms"]
    except (OSError, ValueError, KeyError):
        pass
    atomic_write_json(path, d, indent=1, sort_keys=False)


def plan_sweep(out: Path, plan: Plan, skip: list[str] = ()) -> tuple[Sweep, dict[str, dict]]:
    """The experiment as a sweep (one run per arm and seed, in plan order: the array index) and
    each run's :func:`arm_state`; a trained arm is only evaluated; ``skip``: runs left out."""
    runs, states = [], {}
    for arm in plan.arms:
        if arm.name in skip:
            continue
        st = states[arm.name] = arm_state(out, plan, arm)
        runs.append(Run(name=arm.name, run_dir=run_dir(out, arm), config=plan.config, overrides=arm.overrides,
                        after=["reproduce", "--evaluate-arm", arm.name, "--out", str(out)],
                        train=st["status"] != "trained", step=st["step"]))
    return Sweep(out=out, runs=runs, tag=TAG, exit_file=EXIT_FILE), states


# ----------------------------------------------------------------------------- LR screens
SCREEN_RESERVED = ("train.eval_depth=", "logging.")  # the tool's own keys of an arm (the screen sets its own)


def screen_dir(out: Path, group: str) -> Path:
    return Path(out) / "screens" / group


def screen_of(out: Path, plan: Plan, group: str):
    """The LR screen of the file's arm ``group`` (a ``megaloop.screen.core.Screen``): its first
    seed's config and overrides at every grid point, in ``OUT/screens/<arm>/lr_<lr>/``."""
    from megaloop.screen.core import WHOLE_SET, Screen

    assert plan.screen is not None
    arm = plan.runs_of(group)[0]
    own = [o for o in arm.overrides if not o.startswith(SCREEN_RESERVED)]
    sp = plan.screen
    return Screen(config=plan.config, out=screen_dir(out, group).resolve(), lrs=list(sp.grid),
                  stop_after=sp.stop_after, max_steps=plan.settings["max_steps"], eval_depth=sp.eval_depth,
                  eval_batches=sp.eval_batches or WHOLE_SET, screen_set=sp.screen_set, overrides=own,
                  micro_batch_size=0, warmup_steps=0)


def screened_groups(plan: Plan) -> list[str]:
    return [g for g in plan.groups() if plan.runs_of(g)[0].lr == "screen"]


def screen_result(out: Path, plan: Plan, group: str) -> dict:
    """``{points: [{lr, status, val_ce, ...}], best_lr, interior, edge, proposed_grid, complete}``
    of one arm's screen (``megaloop.screen.core.select_best`` over its finished points)."""
    from megaloop.screen.core import point_state, select_best

    screen = screen_of(out, plan, group)
    points = [{"lr": lr, **point_state(screen.run_dir(lr), screen.end_step)} for lr in screen.lrs]
    return {**select_best(points), "points": points, "stop_after": screen.end_step,
            "eval_depth": screen.eval_depth, "screen_set": screen.screen_set}


def resolve_lrs(out: Path, plan: Plan) -> tuple[Plan, dict[str, dict], list[str]]:
    """The plan with every screened (and ``same_as``) arm's ``optim.lr`` set from its finished
    screen; each screened arm's :func:`screen_result`; and the runs still waiting for a screen."""
    import dataclasses

    from megaloop.screen.core import lr_tag

    results = {g: screen_result(out, plan, g) for g in screened_groups(plan)}
    arms, waiting = [], []
    for arm in plan.arms:
        source = arm.lr_source
        if source is None:
            arms.append(arm)
            continue
        res = results[source]
        if not res["complete"] or res["best_lr"] is None:
            waiting.append(arm.name)
            arms.append(arm)
            continue
        arms.append(dataclasses.replace(arm, overrides=[*arm.overrides, f"optim.lr={lr_tag(res['best_lr'])}"]))
    return dataclasses.replace(plan, arms=arms), results, waiting


def screen_sweep(out: Path, plan: Plan) -> Sweep:
    """Every screened arm's grid points as one sweep (``screen_exit`` per point)."""
    from megaloop.screen.core import EXIT_FILE

    runs = []
    for g in screened_groups(plan):
        for run in screen_of(out, plan, g).sweep().runs:
            runs.append(Run(name=f"{g}/{run.name}", run_dir=run.run_dir, config=run.config, overrides=run.overrides))
    return Sweep(out=out, runs=runs, tag=TAG, exit_file=EXIT_FILE)


def screen_point_done(out: Path, plan: Plan, run: Run) -> str | None:
    """Why a screen point needs no launch (finished or diverged), else None."""
    from megaloop.screen.core import TERMINAL, point_state

    assert plan.screen is not None
    st = point_state(run.run_dir, min(plan.screen.stop_after, plan.settings["max_steps"]))
    return f"{st['status']} (val_ce {st['val_ce']})" if st["status"] in TERMINAL else None
