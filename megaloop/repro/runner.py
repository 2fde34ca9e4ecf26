"""Train and evaluate an experiment's arms: arm state (skip / resume), local and slurm launchers.

Layout of an experiment directory ``OUT``: ``plan.json`` (the resolved experiment), ``arms/<arm>/``
(one megaloop run directory per arm: ``train.log``, ``metrics.jsonl``, ``checkpoints/``,
``repro_arm.json`` = the arm's identity, ``repro_exit`` = the last training exit status,
``eval/``), ``launches.jsonl`` (one line per launch) and, for slurm, ``slurm/``.

* **local**: ``parallel`` worker threads; each takes the next arm, trains it (``megaloop train
  --resume auto``, its own session, ``OMP_NUM_THREADS`` = the arm's thread share) and evaluates
  it (``megaloop.repro.evaluate``). Ctrl-C / SIGTERM ask the training processes to checkpoint
  (SIGTERM: the trainer saves and exits 75), stop the evaluations, and return; a rerun resumes.
* **slurm**: one array job over the unfinished arms, each task running ``slurm/reproduce_array.sh``
  (``megaloop_train`` of slurm/common.sh, then the evaluation); arms whose task is still queued or
  running are not resubmitted.
"""

from __future__ import annotations

import json
import os
import queue
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from megaloop.repro.evaluate import checkpoint_step, eval_done, evaluate_arm
from megaloop.repro.spec import Arm, Plan, SpecError, identity_overrides
from megaloop.screen.launch import active_array_tasks, compress_indices

ROOT = Path(__file__).resolve().parents[2]  # the repository: subprocesses run from here
EXIT_REQUEUE = 75
TRAIN_SIGNAL_EXITS = (EXIT_REQUEUE, 128 + signal.SIGINT, 128 + signal.SIGTERM, -signal.SIGTERM, -signal.SIGINT,
                      -signal.SIGKILL)


def log(msg: str) -> None:
    print(f"[reproduce] {msg}", flush=True)


def run_dir(out: Path, arm: Arm | str) -> Path:
    return Path(out) / "arms" / (arm if isinstance(arm, str) else arm.name)


def write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    tmp.write_text(json.dumps(obj, indent=1, allow_nan=True) + "\n")
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- state
def arm_state(out: Path, plan: Plan, arm: Arm) -> dict:
    """``{status, step, exit_code}``; status is one of

    done (trained to train.max_steps and evaluated with this plan), trained (evaluation missing,
    failed or stale), partial (a checkpoint before the last step: resumed next time), failed (the
    last training exited with an error before finishing), interrupted (stopped by a signal),
    pending (never started).
    """
    rd = run_dir(out, arm)
    max_steps = plan.settings["max_steps"]
    st: dict[str, Any] = {"status": "pending", "step": None, "exit_code": None}
    if not rd.exists():
        return st
    step = checkpoint_step(rd)
    st["step"] = step
    exit_file = rd / "repro_exit"
    if exit_file.is_file():
        try:
            st["exit_code"] = int(exit_file.read_text().strip())
        except ValueError:
            pass
    if step is not None and step >= max_steps:
        st["status"] = "done" if eval_done(rd, plan.eval, step) else "trained"
    elif st["exit_code"] in TRAIN_SIGNAL_EXITS:
        st["status"] = "interrupted"
    elif st["exit_code"] not in (None, 0):
        st["status"] = "failed"
    elif step is not None or (rd / "metrics.jsonl").is_file():
        st["status"] = "partial"
    return st


def check_identity(out: Path, plan: Plan, arm: Arm) -> None:
    """An arm directory may only be resumed with the overrides it was started with."""
    path = run_dir(out, arm) / "repro_arm.json"
    mine = {"config": plan.config, "overrides": identity_overrides(arm.overrides)}
    if not path.is_file():
        return
    try:
        old = json.loads(path.read_text())
    except ValueError:
        return
    old = {"config": old.get("config"), "overrides": old.get("overrides")}
    if old != mine:
        changed = sorted(set(old["overrides"] or []) ^ set(mine["overrides"])) or [f"config {old['config']}"]
        raise SpecError(f"--out: arm {arm.name!r} in {path.parent} was started with other settings "
                        f"(differs in: {' '.join(changed)}); use a new --out or the same experiment/scale/overrides")


def _mark_started(out: Path, plan: Plan, arm: Arm) -> Path:
    rd = run_dir(out, arm)
    rd.mkdir(parents=True, exist_ok=True)
    write_json(rd / "repro_arm.json", {"experiment": plan.experiment, "scale": plan.scale, "arm": arm.name,
                                       "config": plan.config, "overrides": identity_overrides(arm.overrides)})
    return rd


def _record_launch(out: Path, arm: str, launcher: str, cmd: list[str], **extra: Any) -> None:
    with open(out / "launches.jsonl", "a") as f:
        f.write(json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "arm": arm, "launcher": launcher,
                            "cmd": cmd, **extra}) + "\n")


def train_command(out: Path, plan: Plan, arm: Arm, nproc: int = 1) -> list[str]:
    """``megaloop train`` of one arm (``torch.distributed.run --standalone`` when ``nproc`` > 1)."""
    if nproc > 1:
        head = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                "-m", "megaloop.cli", "train"]
    else:
        head = [sys.executable, "-m", "megaloop.cli", "train"]
    return [*head, "--config", plan.config, "--run-dir", str(run_dir(out, arm)), "--resume", "auto",
            *arm.overrides]


# ----------------------------------------------------------------------------- local
class _Stop(Exception):
    pass


class LocalRunner:
    """Train + evaluate arms in ``parallel`` worker threads, ``threads`` CPU threads per arm.

    ``devices``: CUDA devices, ``nproc`` per arm (slot i gets devices[i*nproc:(i+1)*nproc]).
    """

    def __init__(self, out: Path, plan: Plan, *, parallel: int, threads: int, nproc: int = 1,
                 devices: list[str] | None = None):
        if parallel < 1 or threads < 1 or nproc < 1:
            raise SpecError(f"--parallel/--threads-per-arm/--nproc: must be >= 1 (got {parallel}/{threads}/{nproc})")
        if devices is not None and len(devices) < parallel * nproc:
            raise SpecError(f"--devices: {len(devices)} device(s) for {parallel} parallel arm(s) x --nproc {nproc}")
        self.out, self.plan, self.parallel, self.threads, self.nproc = Path(out), plan, parallel, threads, nproc
        self.devices = devices
        self.stop = threading.Event()
        self.procs: dict[int, tuple[str, subprocess.Popen]] = {}  # slot -> (kind, process)
        self.lock = threading.Lock()
        self.results: dict[str, str] = {}

    def _env(self, slot: int) -> dict:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(self.threads),
               "MKL_NUM_THREADS": str(self.threads)}
        if self.devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.devices[slot * self.nproc:(slot + 1) * self.nproc])
        return env

    def _spawn(self, slot: int, kind: str, argv: list[str], logf, env: dict) -> int:
        if self.stop.is_set():
            return 128 + signal.SIGTERM
        # own session: a terminal's Ctrl-C reaches only this tool, which then asks the runs to
        # checkpoint (SIGTERM) instead of killing them mid-step
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=logf, stderr=subprocess.STDOUT,
                                start_new_session=True)
        with self.lock:
            self.procs[slot] = (kind, proc)
        try:
            return proc.wait()
        finally:
            with self.lock:
                self.procs.pop(slot, None)

    def _pipeline(self, slot: int, arm: Arm) -> str:
        rd = _mark_started(self.out, self.plan, arm)
        max_steps = self.plan.settings["max_steps"]
        env = self._env(slot)
        step = checkpoint_step(rd)
        if step is None or step < max_steps:
            cmd = train_command(self.out, self.plan, arm, self.nproc)
            (rd / "repro_exit").unlink(missing_ok=True)
            log(f"train {arm.name}{f' (resuming from step {step})' if step else ''}: {rd}/train.log")
            _record_launch(self.out, arm.name, "local", cmd, resumed=step is not None, slot=slot)
            t0 = time.time()
            with open(rd / "train.log", "a") as logf:
                logf.write(f"=== reproduce {time.strftime('%Y-%m-%dT%H:%M:%S')}: {shlex.join(cmd)}\n")
                logf.flush()
                code = self._spawn(slot, "train", cmd, logf, env)
            (rd / "repro_exit").write_text(f"{code}\n")
            step = checkpoint_step(rd)
            log(f"{arm.name}: training exited {code} at step {step}/{max_steps} ({time.time() - t0:.0f}s)")
            if code != 0 or step is None or step < max_steps:
                if code not in (0, *TRAIN_SIGNAL_EXITS):
                    for line in (rd / "train.log").read_text(errors="replace").splitlines()[-6:]:
                        print(f"    | {line}", flush=True)
                return "interrupted" if code in TRAIN_SIGNAL_EXITS else ("failed" if code else "partial")
        if self.stop.is_set():
            return "interrupted"

        def run(argv: list[str], logpath: Path, env_: dict) -> int:
            with open(logpath, "a") as f:
                f.write(f"=== reproduce {time.strftime('%Y-%m-%dT%H:%M:%S')}: {shlex.join(argv)}\n")
                f.flush()
                return self._spawn(slot, "eval", argv, f, {**env_, **env})

        s = evaluate_arm(rd, arm, self.plan.eval, max_steps=max_steps, threads=self.threads, run=run, log=log)
        return "done" if s["complete"] else "eval failed"

    def _worker(self, slot: int, todo: "queue.Queue[Arm]") -> None:
        while not self.stop.is_set():
            try:
                arm = todo.get_nowait()
            except queue.Empty:
                return
            try:
                self.results[arm.name] = self._pipeline(slot, arm)
            except Exception as err:  # noqa: BLE001 (one arm's error must not stop the others)
                self.results[arm.name] = f"error: {err}"
                log(f"{arm.name}: {type(err).__name__}: {err}")

    def run(self, arms: list[Arm]) -> dict[str, str]:
        """Run ``arms``; returns arm -> outcome. Raises KeyboardInterrupt after a Ctrl-C/SIGTERM
        once every running training has checkpointed."""
        todo: "queue.Queue[Arm]" = queue.Queue()
        for a in arms:
            todo.put(a)
        workers = [threading.Thread(target=self._worker, args=(i, todo), daemon=True)
                   for i in range(min(self.parallel, len(arms)))]

        def on_term(signum, _frame):  # noqa: ANN001
            raise _Stop(signal.Signals(signum).name)

        old = signal.signal(signal.SIGTERM, on_term)
        try:
            for w in workers:
                w.start()
            try:
                while any(w.is_alive() for w in workers):
                    time.sleep(0.2)
            except (KeyboardInterrupt, _Stop) as why:
                self.stop.set()
                with self.lock:
                    live = list(self.procs.values())
                log(f"interrupted ({str(why) or 'SIGINT'}): asking {sum(k == 'train' for k, _ in live)} training run(s) "
                    "to checkpoint and stop")
                for _, proc in live:
                    try:
                        proc.send_signal(signal.SIGTERM)
                    except ProcessLookupError:
                        pass
                deadline = time.time() + 600
                for w in workers:
                    w.join(timeout=max(1.0, deadline - time.time()))
                with self.lock:
                    for _, proc in self.procs.values():
                        proc.kill()
                raise KeyboardInterrupt from None
        finally:
            signal.signal(signal.SIGTERM, old)
        return self.results


# ----------------------------------------------------------------------------- slurm
def _need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        raise SpecError(f"--launcher slurm: {tool!r} not found on PATH (run on a slurm login node)")
    return path


def slurm_jobs(out: Path) -> list[dict]:
    path = Path(out) / "slurm" / "jobs.jsonl"
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def slurm_active(out: Path) -> dict[str, str]:
    """Arm -> job id of arms whose array task is still queued or running (squeue)."""
    jobs = slurm_jobs(out)
    if jobs:
        _need("squeue")
    active: dict[str, str] = {}
    for job in jobs:
        for i in active_array_tasks(str(job["job_id"])) or ():
            name = job["arms"].get(str(i))
            if name is not None:
                active[name] = str(job["job_id"])
    return active


def write_arm_args(args_dir: Path, out: Path, plan: Plan, arm: Arm, index: int) -> Path:
    """``ARGS_DIR/arm_<i>.args``: config, run dir, arm name, then one override per line."""
    lines = [plan.config, str(run_dir(out, arm)), arm.name, *arm.overrides]
    for x in lines:
        if "\n" in x:
            raise SpecError(f"arm {arm.name!r}: override {x!r}: newlines are not supported with --launcher slurm")
    path = args_dir / f"arm_{index}.args"
    path.write_text("\n".join(lines) + "\n")
    return path


def sbatch_command(out: Path, plan: Plan, indices: list[int], parallel: int | None,
                   sbatch_args: list[str]) -> list[str]:
    array = compress_indices(indices) + (f"%{parallel}" if parallel else "")
    return ["sbatch", "--parsable", f"--array={array}", f"--job-name=repro-{plan.experiment}-{plan.scale}",
            f"--chdir={ROOT}", "--export=ALL", f"--output={Path(out) / 'slurm' / '%A_%a.out'}", *sbatch_args,
            str(ROOT / "slurm" / "reproduce_array.sh")]


def submit_slurm(out: Path, plan: Plan, todo: list[Arm], parallel: int | None, sbatch_args: list[str],
                 dry_run: bool = False) -> str | None:
    """One array job over ``todo`` (index = the arm's position in the plan). Each submission has
    its own ``OUT/slurm/sub<k>/`` of arm files (``REPRO_ARMS_DIR``), so later submissions never
    change what a queued task reads."""
    index = {a.name: i for i, a in enumerate(plan.arms)}
    indices = [index[a.name] for a in todo]
    cmd = sbatch_command(out, plan, indices, parallel, sbatch_args)
    if dry_run:
        log(f"would run: REPRO_DIR={out} {shlex.join(cmd)}")
        for a in todo:
            log(f"  arm {index[a.name]} {a.name}: megaloop train --config {plan.config} {shlex.join(a.overrides)}")
        return None
    args_dir = Path(out) / "slurm" / f"sub{len(slurm_jobs(out)):03d}"
    args_dir.mkdir(parents=True, exist_ok=True)
    for a in todo:
        _mark_started(out, plan, a)
        write_arm_args(args_dir, out, plan, a, index[a.name])
    cmd[0] = _need("sbatch")
    env = {**os.environ, "REPRO_DIR": str(out), "REPRO_ARMS_DIR": str(args_dir), "MEGALOOP_ROOT": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"sbatch failed (exit {proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    job_id = proc.stdout.strip().split(";")[0].strip()
    if not job_id:
        raise RuntimeError(f"sbatch printed no job id: {proc.stdout!r}")
    with open(Path(out) / "slurm" / "jobs.jsonl", "a") as f:
        f.write(json.dumps({"job_id": job_id, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "args_dir": str(args_dir),
                            "arms": {str(index[a.name]): a.name for a in todo}, "cmd": cmd}) + "\n")
    for a in todo:
        _record_launch(out, a.name, "slurm", cmd, job_id=job_id, array_index=index[a.name])
    log(f"submitted array job {job_id} ({len(todo)} arm(s): --array={compress_indices(indices)}); "
        f"logs in {Path(out) / 'slurm'}")
    return job_id


def wait_slurm(out: Path, poll: float) -> None:
    """Poll squeue until none of the experiment's array tasks is queued or running."""
    last = None
    while True:
        active = slurm_active(out)
        if not active:
            log("no array task of this experiment left in the queue")
            return
        if active != last:
            log(f"{len(active)} arm(s) queued or running: {', '.join(sorted(active))}")
            last = active
        time.sleep(poll)


__all__ = ["LocalRunner", "arm_state", "check_identity", "run_dir", "sbatch_command", "slurm_active",
           "submit_slurm", "train_command", "wait_slurm", "write_arm_args"]
