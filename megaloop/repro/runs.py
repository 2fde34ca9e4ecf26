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

from megaloop.repro.evaluate import checkpoint_step, eval_done
from megaloop.repro.spec import Arm, Plan, SpecError, identity_overrides
from megaloop.runtime.files import atomic_write_json
from megaloop.sweep import Run, Sweep, read_exit, started_with, stopped

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


def check_identity(out: Path, plan: Plan, arm: Arm) -> None:
    """An arm directory may only be resumed with the config and overrides it was started with
    (run-control keys aside: ``spec.IDENTITY_IGNORED``)."""
    old = started_with(run_dir(out, arm))
    if old is None:
        return
    mine = {"config": plan.config, "overrides": identity_overrides(arm.overrides)}
    theirs = {"config": old.get("config"), "overrides": identity_overrides(old.get("overrides") or [])}
    if theirs != mine:
        changed = sorted(set(theirs["overrides"]) ^ set(mine["overrides"])) or [f"config {theirs['config']}"]
        raise SpecError(f"--out: arm {arm.name!r} in {run_dir(out, arm)} was started with other settings "
                        f"(differs in: {' '.join(changed)}); use a new --out or the same experiment/scale/overrides")


def check_out(out: Path, plan: Plan) -> None:
    """OUT holds this experiment at this scale (or nothing), and no arm started differently."""
    path = out / "plan.json"
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if (old.get("experiment"), old.get("scale")) != (plan.experiment, plan.scale):
        raise SpecError(f"--out: {out} holds experiment {old.get('experiment')!r} at scale {old.get('scale')!r}, "
                        f"not {plan.experiment!r} at {plan.scale!r}; use another --out")
    for arm in plan.arms:
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


def plan_sweep(out: Path, plan: Plan) -> tuple[Sweep, dict[str, dict]]:
    """The experiment as a sweep (one run per arm, in plan order: the array index) and each arm's
    :func:`arm_state`; a trained arm is only evaluated."""
    runs, states = [], {}
    for arm in plan.arms:
        st = states[arm.name] = arm_state(out, plan, arm)
        runs.append(Run(name=arm.name, run_dir=run_dir(out, arm), config=plan.config, overrides=arm.overrides,
                        after=["reproduce", "--evaluate-arm", arm.name, "--out", str(out)],
                        train=st["status"] != "trained", step=st["step"]))
    return Sweep(out=out, runs=runs, tag=TAG, exit_file=EXIT_FILE), states
