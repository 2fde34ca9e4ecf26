"""One arm's evaluation plan: depth sweep (+ sharing penalty) and local harness tasks.

Runs the ``megaloop eval`` commands as subprocesses on the arm's final checkpoint and writes

* ``RUN/eval/sweep.json`` + ``sweep.png``: ``megaloop eval sweep --depth R --depths ... --sharing``
  (native PPL at every depth, terminal / per-visit PPL and the sharing penalty
  100·(PPL_terminal/PPL_per_visit − 1) at every depth, extrapolation 100·(PPL@max/PPL@R − 1));
  untied arms (no recurrence, so no depth flags: the eval commands refuse them) run ``megaloop eval
  ppl --cache both`` instead (``RUN/eval/ppl.json``: the same native / terminal / per-visit PPL and
  sharing penalty, recorded as the one row at R);
* ``RUN/eval/harness.json``: ``megaloop eval harness --tasks ...`` (terminal cache, depth R);
* ``RUN/eval/summary.json``: the checkpoint step, the plan's digest, each stage's status and the
  extracted metrics (see ``summarize``), and the machine that evaluated.

A stage is skipped when the summary records it for the same checkpoint step and plan digest, so
an interrupted evaluation redoes only the missing stages. The launcher runs it after an arm's
training as ``megaloop reproduce --evaluate-arm NAME --out OUT`` (megaloop/repro/cli.py).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from megaloop.repro.spec import Arm, EvalPlan, SpecError
from megaloop.runtime.files import atomic_write_json, json_safe
from megaloop.sweep import stopped

SUMMARY = "summary.json"


def _warn_old_synth_tree(tree: Path) -> None:
    """A warning (before training) when ``tree`` is a synthetic tree of generator 1, whose training
    programs could show held-out answers (``megaloop.data.synth``); a note in each arm's evaluation
    log alone was easy to miss."""
    import sys

    from megaloop.data.synth import GENERATOR, tree_generator
    from megaloop.data.tokenizer import read_manifest

    info = read_manifest(tree, "synth.json")
    if info is not None and tree_generator(info) < GENERATOR:
        print(f"warning: {tree} was made by an earlier make_synth.py: its training programs may show the answers "
              "of held-out problems with k <= 3, which the synthetic claims score; rebuild it (bash launch/synth.sh "
              "with a new DATA_DIR) for an uncontaminated comparison", file=sys.stderr, flush=True)


def check_eval_inputs(plan: EvalPlan, where: str, files: bool = True) -> None:
    """What the arms' evaluation reads, checked before any arm trains: a missing ``eval.data`` or
    ``eval.synth`` file or an unknown harness task failed only after every arm had trained.
    ``SpecError`` naming the field. ``files=False`` (``--dry-run``: data may be built later)
    checks the task names alone."""
    from megaloop.config_utils import ConfigError
    from megaloop.eval.harness import TASKS_DIR, _local_task_files
    from megaloop.eval.text_data import text_format

    from megaloop.data.config import EMBEDDED_SPLITS

    data = Path(plan.data)  # what `megaloop eval --data` takes: default[:split], an MDS folder, a text file
    if plan.data.startswith("default:") and plan.data.split(":", 1)[1] not in EMBEDDED_SPLITS:
        raise SpecError(f"{where}: eval.data: unknown embedded split {plan.data!r} "
                        f"({', '.join('default:' + s for s in EMBEDDED_SPLITS)})")
    if files and not (plan.data == "default" or plan.data.startswith("default:") or data.is_dir()
                      or (data.is_file() and text_format(plan.data) is not None)):
        raise SpecError(f"{where}: eval.data: {plan.data} is no MDS validation folder or text file "
                        "(.txt, .jsonl[.gz], .parquet), nor 'default'")
    if files and plan.synth not in (None, "shipped") and not Path(plan.synth).is_file():
        raise SpecError(f"{where}: eval.synth: {plan.synth} is not a file (a held-out problems JSONL of "
                        "data_prep/make_synth.py, or 'shipped')")
    if files and plan.synth not in (None, "shipped"):
        _warn_old_synth_tree(Path(plan.synth).parent)
    if set(plan.harness) - set(_local_task_files([TASKS_DIR])):  # the shipped tasks need no lm-eval index
        from megaloop.eval.harness import resolve_tasks

        try:
            resolve_tasks(plan.harness)
        except ConfigError as err:
            raise SpecError(f"{where}: eval.harness: {err}") from None
RunFn = Callable[[list[str], Path, dict], int]  # (argv, log file, env) -> exit status


def checkpoint_step(run_dir: Path) -> int | None:
    """Step of the newest complete checkpoint of ``run_dir`` (None: no checkpoint)."""
    import warnings

    with warnings.catch_warnings():  # megatron's "Transformer Engine / Apex not installed" notices
        warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|apex).*")
        from megaloop.train.checkpoint import CheckpointManager

    latest = CheckpointManager(run_dir / "checkpoints").latest()
    if latest is None:
        return None
    try:
        return int(json.loads((latest / "megaloop.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return int(latest.name.split("_")[-1])


def machine() -> dict:
    """What evaluated (and, in both launchers, trained) the arm: CPU model, cores, accelerators."""
    info = {"platform": platform.platform(terse=True), "python": platform.python_version(),
            "cpus": os.cpu_count()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        info["cpu"] = platform.processor() or "unknown"
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except ImportError:  # pragma: no cover
        pass
    return info


def _run_plain(argv: list[str], log: Path, env: dict) -> int:
    """Run one stage; it gets SIGTERM when this process dies, however it dies (a ``kill -9`` of the
    ``--evaluate-arm`` process left the stage evaluating on as an orphan, beside the next arm's training
    and, later, a rerun's stage writing the same ``eval/*.json``)."""
    with open(log, "a") as f:
        f.write(f"=== {time.strftime('%Y-%m-%dT%H:%M:%S')}: {' '.join(argv)}\n")
        f.flush()
        guarded = [sys.executable, "-m", "megaloop.runtime.orphan_guard", str(os.getpid()), "--", *argv]
        return subprocess.run(guarded, stdout=f, stderr=subprocess.STDOUT, env=env).returncode


def stage_commands(run_dir: Path, arm: Arm, plan: EvalPlan, *, threads: int | None, device: str,
                   python: str = sys.executable) -> dict[str, list[str]]:
    """``{stage: argv}`` of the arm's evaluation: ``synth`` (with ``eval.synth``), ``sweep`` (unless
    ``eval.sweep`` is false; an untied arm: ``ppl``, one depth) and, with harness tasks, ``harness``.
    An untied arm's commands carry no depth flag (``--depth``, ``--depths``: refused on such a model)."""
    out = run_dir / "eval"
    head = [python, "-m", "megaloop.cli", "eval"]
    common = ["--checkpoint", str(run_dir), *(["--depth", str(plan.depth)] if arm.looped else []), "--device", device]
    if threads:
        common += ["--threads", str(threads)]
    cmds: dict[str, list[str]] = {}
    if plan.synth:
        cmds["synth"] = [*head, "synth", "--checkpoint", str(run_dir), "--device", device,
                         *(["--depths", ",".join(map(str, plan.depths))] if arm.looped else []),
                         "--json", str(out / "synth.json"), "--plot", str(out / "synth.png")]
        cmds["synth"] += ["--threads", str(threads)] if threads else []
        from megaloop.eval.synth import SHIPPED  # "shipped" names the file: eval synth's own default is
        # the held-out set of the run's tree

        cmds["synth"] += ["--problems", plan.synth if plan.synth != "shipped" else str(SHIPPED)]
    if plan.sweep and arm.looped:
        sweep = [*head, "sweep", *common, "--depths", ",".join(map(str, plan.depths)), "--data", plan.data,
                 "--batch-size", str(plan.batch_size), "--json", str(out / "sweep.json"),
                 "--plot", str(out / "sweep.png")]
        if plan.sharing:
            sweep.append("--sharing")
        if plan.max_seqs:
            sweep += ["--max-seqs", str(plan.max_seqs)]
        cmds["sweep"] = sweep
    elif plan.sweep:  # untied: native PPL and the cache protocols at its one depth
        ppl = [*head, "ppl", *common, "--cache", "both", "--data", plan.data, "--batch-size", str(plan.batch_size),
               "--json", str(out / "ppl.json")]
        cmds["ppl"] = ppl + (["--max-seqs", str(plan.max_seqs)] if plan.max_seqs else [])
    if plan.harness:
        h = [*head, "harness", *common, "--tasks", ",".join(plan.harness), "--json", str(out / "harness.json")]
        if plan.harness_limit:
            h += ["--limit", str(plan.harness_limit)]
        cmds["harness"] = h
    return cmds


def summarize(run_dir: Path, plan: EvalPlan, looped: bool) -> dict:
    """Metrics from the stage JSONs: ``native_ppl, terminal_ppl, per_visit_ppl,
    sharing_penalty_pct`` at R, ``extrapolation_pct`` (looped only), ``sweep`` rows,
    ``downstream`` (mean ``acc`` over the harness tasks) and ``harness`` (task -> metrics)."""
    out: dict = {}
    sweep_path, ppl_path = run_dir / "eval" / "sweep.json", run_dir / "eval" / "ppl.json"
    if not looped and ppl_path.is_file():  # an untied arm: one row, at R
        p = json.loads(ppl_path.read_text())
        row = {"depth": plan.depth, **{k: p.get(k) for k in ("native_ppl", "terminal_ppl", "per_visit_ppl",
                                                             "sharing_penalty_pct")}}
        out.update({k: v for k, v in row.items() if k != "depth"}, sweep=[row], extrapolation_pct=None,
                   extrapolation_depth=plan.depth, eval_seqs=p.get("num_seqs"), eval_seq_len=p.get("seq_len"))
    elif sweep_path.is_file():
        sw = json.loads(sweep_path.read_text())
        rows = [{k: r.get(k) for k in ("depth", "native_ppl", "terminal_ppl", "per_visit_ppl",
                                       "sharing_penalty_pct")} for r in sw["rows"]]
        at_r = next((r for r in rows if r["depth"] == plan.depth), {})
        out.update(native_ppl=at_r.get("native_ppl", sw.get("reference_native_ppl")),
                   terminal_ppl=at_r.get("terminal_ppl"), per_visit_ppl=at_r.get("per_visit_ppl"),
                   sharing_penalty_pct=at_r.get("sharing_penalty_pct"), sweep=rows,
                   extrapolation_pct=sw.get("extrapolation_pct") if looped and sw.get("deepest", 0) > plan.depth
                   else None, extrapolation_depth=sw.get("deepest"), eval_seqs=sw.get("num_seqs"),
                   eval_seq_len=sw.get("seq_len"))
    harness_path = run_dir / "eval" / "harness.json"
    if harness_path.is_file():
        res = json.loads(harness_path.read_text()).get("results", {})
        out["harness"] = res
        accs = [m["acc"] for m in res.values() if isinstance(m.get("acc"), (int, float))]
        out["downstream"] = sum(accs) / len(accs) if accs else None
    synth_path = run_dir / "eval" / "synth.json"
    if plan.synth and synth_path.is_file():
        table = json.loads(synth_path.read_text())
        if not looped and len(table.get("depths") or []) == 1:  # an untied model's one column: at R
            table = {**table, "depths": [plan.depth]}
        out.update(synth_metrics(table, plan.depth, plan.synth_min_k))
    return out


def synth_curve(table: dict, min_k: int) -> list[float] | None:
    """Answer accuracy over held-out k >= ``min_k`` (weighted by problems per k) at each of the
    table's depths; None when no k >= ``min_k`` was scored. ``table``: ``megaloop eval synth``'s
    JSON (``ks``, ``depths``, ``acc`` [k][depth], ``n`` per k)."""
    rows = [i for i, k in enumerate(table["ks"]) if k >= min_k]
    if not rows:
        return None
    total = sum(table["n"][i] for i in rows)
    return [sum(table["acc"][i][j] * table["n"][i] for i in rows) / total for j in range(len(table["depths"]))]


def synth_metrics(table: dict, depth: int, min_k: int) -> dict:
    """``synth_acc`` / ``synth_acc_r1``: :func:`synth_curve` at the training depth R and at R=1
    (None where not scored); ``synth_extrap_pts``: 100 x (accuracy at the deepest depth − accuracy
    at R), in points; ``synth_table``: the k x R accuracies and problems per k."""
    depths, curve = table["depths"], synth_curve(table, min_k)

    def at(d: int) -> float | None:
        return curve[depths.index(d)] if curve is not None and d in depths else None

    at_r, deepest = at(depth), at(max(depths))
    return {"synth_acc": at_r, "synth_acc_r1": at(1),
            "synth_extrap_pts": 100.0 * (deepest - at_r) if at_r is not None and deepest is not None
            and max(depths) > depth else None,
            "synth_table": {k: table[k] for k in ("ks", "depths", "acc", "n")}}


def evaluate_arm(run_dir: Path, arm: Arm, plan: EvalPlan, *, max_steps: int, threads: int | None = None,
                 device: str = "auto", run: RunFn = _run_plain, log: Callable[[str], None] = print) -> dict:
    """Run the missing stages of ``arm``'s evaluation; returns the summary (``complete`` True
    when every stage succeeded). Refuses (``RuntimeError``) a run that has not finished training."""
    run_dir = Path(run_dir)
    step = checkpoint_step(run_dir)
    if step is None or step < max_steps:
        raise RuntimeError(f"arm {arm.name}: training not finished (checkpoint step {step}, "
                           f"train.max_steps {max_steps}); resume it first")
    out = run_dir / "eval"
    out.mkdir(parents=True, exist_ok=True)
    digest = plan.digest()
    path = out / SUMMARY
    summary = json.loads(path.read_text()) if path.is_file() else {}
    if summary.get("step") != step or summary.get("eval_digest") != digest:
        summary = {"step": step, "eval_digest": digest, "stages": {}}
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    ok = True
    for stage, argv in stage_commands(run_dir, arm, plan, threads=threads, device=device).items():
        if summary["stages"].get(stage) == "ok" and (out / f"{stage}.json").is_file():
            log(f"{arm.name}: eval {stage} already done (step {step})")
            continue
        t0 = time.time()
        code = run(argv, out / f"{stage}.log", env)
        summary["stages"][stage] = "ok" if code == 0 else f"exit {code}"
        what = "done" if code == 0 else \
            f"{'interrupted' if stopped(code) else 'FAILED'} (exit {code}, see {out / (stage + '.log')})"
        log(f"{arm.name}: eval {stage} {what} in {time.time() - t0:.0f}s")
        _write(path, summary)
        if code != 0:
            ok = False
            break
    summary["metrics"] = summarize(run_dir, plan, arm.looped)
    summary["machine"] = machine()
    summary["complete"] = ok
    _write(path, summary)
    return summary


def eval_done(run_dir: Path, plan: EvalPlan, step: int | None) -> bool:
    """True when ``run_dir``'s evaluation is complete for checkpoint ``step`` and this plan."""
    path = Path(run_dir) / "eval" / SUMMARY
    if step is None or not path.is_file():
        return False
    try:
        s = json.loads(path.read_text())
    except ValueError:
        return False
    return bool(s.get("complete")) and s.get("step") == step and s.get("eval_digest") == plan.digest()


def _write(path: Path, obj: dict) -> None:
    atomic_write_json(path, json_safe(obj), indent=1, sort_keys=False)  # NaN/inf as null (strict JSON)
