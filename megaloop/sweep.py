"""One launcher for grids of training runs; the LR screen and the paper reproduction are plans on it.

A :class:`Sweep` is a directory ``OUT`` and a plan of :class:`Run` s (name -> ``megaloop train``
config and overrides, run directory, and optionally a ``megaloop`` verb run once the training
exited 0, e.g. the evaluation). :func:`execute` runs the unfinished ones

* **local**: a pool of ``parallel`` worker threads; each takes the next run, trains it (``megaloop
  train --resume auto``, its own session, ``OMP_NUM_THREADS`` = its share of the thread budget),
  then runs its ``after`` verb. Ctrl-C / SIGTERM ask the trainings to checkpoint (the trainer
  saves and exits ``EXIT_REQUEUE``), stop the rest and raise KeyboardInterrupt; a rerun resumes.
* **slurm**: one array job over them (array index = the run's position in the plan), each task
  running ``slurm/sweep_array.sh``; runs whose task is still queued or running are not resubmitted.

On disk, per run: ``RUN_DIR/sweep_run.json`` (name, config, overrides, launcher; rewritten
atomically at every launch) and ``RUN_DIR/<exit_file>`` (the last training's exit status); per
sweep: ``OUT/launches.jsonl`` (one line per training launch) and ``OUT/slurm/`` (``jobs.jsonl``,
one ``sub<k>/`` of task files per submission, the tasks' logs).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import queue
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from megaloop.errors import UserError, report
from megaloop.runtime.exits import EXIT_REQUEUE
from megaloop.runtime.files import atomic_write_json, atomic_write_text
from megaloop.sweep_out import check_out_dir

ROOT = Path(__file__).resolve().parents[1]  # the repository (its slurm/ scripts); runs start in the caller's cwd
ARRAY_SCRIPT = ROOT / "slurm" / "sweep_array.sh"
RUN_FILE = "sweep_run.json"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)
STOP_TIMEOUT_S = 600  # how long a stopped local sweep waits for its trainings to checkpoint


class SubmitError(RuntimeError):
    """sbatch refused a submission (exit status 1, not a usage error)."""


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")


def stopped(code: int | None) -> bool:
    """An exit that means "stopped, resume me": the trainer's requeue status, or killed by
    SIGINT / SIGTERM / SIGKILL (negative: seen by Popen; 128+N: seen by a shell)."""
    return code is not None and (code == EXIT_REQUEUE or -code in STOP_SIGNALS or code - 128 in STOP_SIGNALS)


def read_exit(run_dir: Path, exit_file: str) -> int | None:
    """The last training exit status recorded in ``run_dir`` (None: none recorded)."""
    try:
        return int((Path(run_dir) / exit_file).read_text().strip())
    except (OSError, ValueError):
        return None


def log_tail(path: Path, lines: int = 8) -> None:
    """Print the last ``lines`` lines of a log (after a failed run)."""
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines()[-lines:]:
            print(f"    | {line}", flush=True)


def megaloop_command(args: list[str], nproc: int = 1) -> list[str]:
    """``python -m megaloop.cli ARGS`` (under ``torch.distributed.run --standalone`` if nproc > 1)."""
    head = [sys.executable]
    if nproc > 1:
        head += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [*head, "-m", "megaloop.cli", *args]


@dataclass
class Run:
    """One training run of a sweep."""

    name: str  # unique in the sweep
    run_dir: Path
    config: str  # `megaloop train --config`: a preset or a YAML path
    overrides: list[str]  # dotlist overrides after the config
    after: list[str] = field(default_factory=list)  # a `megaloop` verb run once the training exited 0
    train: bool = True  # False: trained already, only `after` runs (local launcher)
    step: int | None = None  # latest checkpoint step, for the log

    def train_args(self) -> list[str]:
        """The arguments of ``megaloop train``."""
        return ["--config", self.config, "--run-dir", str(self.run_dir), "--resume", "auto", *self.overrides]


@dataclass
class Sweep:
    """A plan of runs in a directory."""

    out: Path
    runs: list[Run]  # in array-index order
    tag: str  # log prefix and slurm job name
    exit_file: str = "sweep_exit"  # RUN_DIR/<exit_file>: the last training's exit status

    def log(self, msg: str) -> None:
        print(f"[{self.tag}] {msg}", flush=True)

    def index(self, run: Run) -> int:
        return next(i for i, r in enumerate(self.runs) if r.name == run.name)

    def record_launch(self, run: Run, launcher: str, cmd: list[str], **extra: object) -> None:
        """``RUN_DIR/sweep_run.json`` (what the run is) and a line of ``OUT/launches.jsonl``."""
        run.run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(run.run_dir / RUN_FILE, {"name": run.name, "config": run.config,
                                                   "overrides": run.overrides, "launcher": launcher,
                                                   "time": now(), **extra}, indent=1, sort_keys=False)
        with open(self.out / "launches.jsonl", "a") as f:
            f.write(json.dumps({"time": now(), "run": run.name, "launcher": launcher, "cmd": cmd, **extra}) + "\n")

    def record_exit(self, run: Run, code: int) -> None:
        atomic_write_text(run.run_dir / self.exit_file, f"{code}\n")


def started_with(run_dir: Path) -> dict | None:
    """``RUN_DIR/sweep_run.json`` of the last launch (None: never launched by a sweep)."""
    try:
        return json.loads((Path(run_dir) / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None


def trained_model_differences(run_dir: Path, config: str, overrides: list[str]) -> str:
    """How the model ``run_dir`` trained (its config.yaml) differs from the one ``config`` with
    ``overrides`` gives now, e.g. after a default changed (``model.k: trained a, now b; ...``; ""
    if it does not, never trained, or its config is unreadable: the training itself reports that)."""
    import yaml

    from megaloop.config import load_config
    from megaloop.config_utils import ConfigError
    from megaloop.model.config import arch_differences, describe_differences

    try:
        saved = (yaml.safe_load((Path(run_dir) / "config.yaml").read_text()) or {}).get("model") or {}
        now = load_config(config, overrides).model
    except (OSError, yaml.YAMLError, ConfigError, AttributeError):
        return ""
    return describe_differences(arch_differences(saved, now), "trained", "now")


# ----------------------------------------------------------------------------- options
@dataclass
class Launch:
    """How a sweep runs (from the command line: :func:`add_launch_args`, :func:`launch_from_args`)."""

    launcher: str = "local"  # local | slurm
    parallel: int | None = None  # local: runs at a time; slurm: array throttle %K (None: none)
    threads: int | None = None  # local: CPU threads of each process (OMP_NUM_THREADS); None: inherit
    nproc: int = 1  # local: processes per run
    devices: list[str] | None = None  # local: CUDA devices, nproc per run
    sbatch_args: list[str] = field(default_factory=list)
    wait: bool = False  # slurm: poll squeue until the array is done
    poll: float = 60.0  # slurm --wait: seconds between polls
    collect: bool = False  # launch nothing
    dry_run: bool = False  # print what would run, write nothing


def add_launch_args(p: argparse.ArgumentParser, default_parallel: str) -> None:
    """The launcher options shared by ``megaloop lr-screen`` and ``megaloop reproduce``."""
    p.add_argument("--launcher", choices=("local", "slurm"), default="local")
    p.add_argument("--parallel", type=int, help=f"local: runs at a time (default {default_parallel}); "
                   "slurm: array throttle %%K (default none)")
    p.add_argument("--threads", type=int, help="local: CPU thread budget split among the runs (default: all usable)")
    p.add_argument("--threads-per-run", "--threads-per-arm", type=int, dest="threads_per_run",
                   help="local: torch threads of each process (default: the budget / runs at a time / --nproc; "
                        "--threads-per-arm is an older name)")
    p.add_argument("--nproc", type=int, default=1, help="local: processes per run (torchrun --standalone)")
    p.add_argument("--devices", help="local: comma-separated CUDA devices, --nproc per run")
    p.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                   help="slurm: extra sbatch argument, repeatable (e.g. --sbatch-arg=--partition=gpu)")
    p.add_argument("--wait", action="store_true", help="slurm: poll squeue until the array finishes, then report")
    p.add_argument("--poll", type=float, help="slurm --wait: seconds between squeue polls (default 60)")
    p.add_argument("--collect", action="store_true", help="launch nothing: collect and report")
    p.add_argument("--dry-run", action="store_true", help="validate and print what would run; write nothing")


def launch_from_args(args: argparse.Namespace, default_parallel: int | None) -> Launch:
    """Options -> :class:`Launch`. The thread budget (``--threads``, default all CPUs) is split:
    ``--parallel`` runs of budget / (parallel x nproc) threads, or budget / ``--threads-per-run``
    runs at a time; with neither, ``default_parallel`` runs (None: one thread per run)."""
    for name in ("parallel", "threads", "threads_per_run", "nproc"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise UserError(f"--{name.replace('_', '-')}: must be >= 1, got {v}")
    # an option of the other launcher would be ignored: refused, as options --render does not read are
    local_only = {"--threads": args.threads, "--threads-per-run": args.threads_per_run, "--devices": args.devices}
    slurm_only = {"--sbatch-arg": args.sbatch_arg or None, "--wait": args.wait or None, "--poll": args.poll}
    for flag, value in (slurm_only if args.launcher == "local" else local_only).items():
        if value is not None:
            raise UserError(f"{flag}: applies to --launcher {'slurm' if args.launcher == 'local' else 'local'} "
                            f"only (this sweep runs with --launcher {args.launcher})")
    if args.poll is not None and not args.wait:
        raise UserError("--poll: goes with --wait (seconds between squeue polls while waiting)")
    if args.poll is None:
        args.poll = 60.0
    elif not (math.isfinite(args.poll) and args.poll > 0):
        raise UserError(f"--poll: seconds between squeue polls, must be > 0, got {args.poll:g}")
    devices = [d.strip() for d in args.devices.split(",") if d.strip()] if args.devices else None
    launch = Launch(launcher=args.launcher, parallel=args.parallel, nproc=args.nproc, devices=devices,
                    sbatch_args=list(args.sbatch_arg), wait=args.wait, poll=args.poll, collect=args.collect,
                    dry_run=args.dry_run)
    if args.launcher == "slurm":
        return launch
    budget = args.threads or len(os.sched_getaffinity(0))  # the CPUs this process may use
    per = args.threads_per_run
    if launch.parallel is None:
        if devices:
            launch.parallel = max(1, len(devices) // args.nproc)
        else:
            launch.parallel = max(1, budget // per) if per else (default_parallel or budget)
    launch.threads = per or max(1, budget // (launch.parallel * args.nproc))
    if devices is not None and len(devices) < launch.parallel * args.nproc:
        raise UserError(f"--devices: {len(devices)} device(s) for {launch.parallel} parallel run(s) "
                        f"x --nproc {args.nproc}")
    return launch


# ----------------------------------------------------------------------------- local
class _Stop(Exception):
    pass


class LocalPool:
    """Train runs (then their ``after`` verb) in ``launch.parallel`` worker threads.

    ``on_exit(run, code)`` is called after each training (e.g. to log the run's result)."""

    def __init__(self, sweep: Sweep, launch: Launch, on_exit: Callable[[Run, int], None] | None = None):
        self.sweep, self.launch, self.on_exit = sweep, launch, on_exit
        self.stop = threading.Event()
        self.procs: dict[int, subprocess.Popen] = {}  # slot -> running process
        self.lock = threading.Lock()

    def _env(self, slot: int) -> dict:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.launch.threads:
            env.update(OMP_NUM_THREADS=str(self.launch.threads), MKL_NUM_THREADS=str(self.launch.threads))
        if self.launch.devices is not None:
            n = self.launch.nproc
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.launch.devices[slot * n:(slot + 1) * n])
        return env

    def _spawn(self, slot: int, argv: list[str], log: Path) -> int:
        if self.stop.is_set():
            return 128 + signal.SIGTERM
        with open(log, "a") as f:
            f.write(f"=== {self.sweep.tag} {now()}: {shlex.join(argv)}\n")
            f.flush()
            # own session: a terminal's Ctrl-C reaches only the launcher, which then asks the runs
            # to checkpoint (SIGTERM) instead of killing them mid-step
            # from the launcher's own directory: relative paths in the overrides (data.path, a screen set,
            # a config YAML) mean what they meant to the checks that ran here before the launch
            # and SIGTERM (checkpoint, stop) when this launcher dies, even of a SIGKILL: orphans trained on
            guarded = [sys.executable, "-m", "megaloop.runtime.orphan_guard", str(os.getpid()), "--", *argv]
            proc = subprocess.Popen(guarded, env=self._env(slot), stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            # registering and reading the stop flag under the lock that `interrupt` sets it under: a
            # stop that came after the check above but before this saw no process, so this one asks it
            with self.lock:
                self.procs[slot] = proc
                late = self.stop.is_set()
            if late:
                self.sweep.log(f"a run started as the stop came: asking it to checkpoint and stop ({log})")
                try:
                    proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
            try:
                return proc.wait()
            finally:
                with self.lock:
                    self.procs.pop(slot, None)

    def _one(self, slot: int, run: Run) -> None:
        log = self.sweep.log
        if run.train:
            cmd = megaloop_command(["train", *run.train_args()], self.launch.nproc)
            resumed = run.step is not None or (run.run_dir / "checkpoints").exists()
            note = f" (resuming from step {run.step})" if run.step else " (resuming)" if resumed else ""
            self.sweep.record_launch(run, "local", cmd, resumed=resumed, slot=slot)
            (run.run_dir / self.sweep.exit_file).unlink(missing_ok=True)
            log(f"train {run.name}{note}: {run.run_dir}/train.log")
            t0 = time.time()
            code = self._spawn(slot, cmd, run.run_dir / "train.log")
            self.sweep.record_exit(run, code)
            log(f"{run.name}: training exited {code} ({time.time() - t0:.0f}s)")
            if self.on_exit:
                self.on_exit(run, code)
            if code != 0 and not stopped(code):
                log_tail(run.run_dir / "train.log")
            if code != 0:
                return
        if run.after and not self.stop.is_set():
            t0 = time.time()
            code = self._spawn(slot, megaloop_command(run.after), run.run_dir / "after.log")
            what = "done" if code == 0 else \
                f"{'interrupted' if stopped(code) else 'FAILED'} (exit {code}, see {run.run_dir / 'after.log'})"
            log(f"{run.name}: {run.after[0]} {what} in {time.time() - t0:.0f}s")

    def _worker(self, slot: int, todo: "queue.Queue[Run]") -> None:
        while not self.stop.is_set():
            try:
                run = todo.get_nowait()
            except queue.Empty:
                return
            try:
                self._one(slot, run)
            except Exception as err:  # noqa: BLE001 (one run's error must not stop the others)
                self.sweep.log(f"{run.name}: {type(err).__name__}: {err}")

    def interrupt(self, why: str) -> None:
        """Set the stop flag and ask every running process to checkpoint and stop (SIGTERM). The flag is
        set under the lock ``_spawn`` registers under, so each process is asked exactly once: here, or
        by ``_spawn`` itself when it registers after this."""
        with self.lock:
            self.stop.set()
            live = list(self.procs.values())
        self.sweep.log(f"interrupted ({why}): asking {len(live)} run(s) to checkpoint and stop")
        for proc in live:
            try:
                proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass

    def run(self, runs: list[Run]) -> None:
        """Run ``runs``; after a Ctrl-C / SIGTERM, raises KeyboardInterrupt once every running
        training has checkpointed (or ``STOP_TIMEOUT_S`` passed)."""
        todo: "queue.Queue[Run]" = queue.Queue()
        for r in runs:
            todo.put(r)
        workers = [threading.Thread(target=self._worker, args=(i, todo), daemon=True)
                   for i in range(min(self.launch.parallel or 1, len(runs)))]

        def on_term(signum, _frame):  # noqa: ANN001
            raise _Stop(signal.Signals(signum).name)

        old = signal.signal(signal.SIGTERM, on_term)
        try:
            for w in workers:
                w.start()
            while any(w.is_alive() for w in workers):
                time.sleep(0.2)
        except (KeyboardInterrupt, _Stop) as why:
            self.interrupt(str(why) or "SIGINT")
            deadline = time.time() + STOP_TIMEOUT_S
            for w in workers:
                w.join(timeout=max(1.0, deadline - time.time()))
            with self.lock:
                for proc in self.procs.values():
                    proc.kill()
            raise KeyboardInterrupt from None
        finally:
            signal.signal(signal.SIGTERM, old)


# ----------------------------------------------------------------------------- slurm
def compress_indices(idx: list[int]) -> str:
    """[0,1,2,5,7,8] -> '0-2,5,7-8' (sbatch --array syntax)."""
    spans = [[i for _, i in g] for _, g in itertools.groupby(enumerate(sorted(idx)), lambda t: t[1] - t[0])]
    return ",".join(str(s[0]) if len(s) == 1 else f"{s[0]}-{s[-1]}" for s in spans)


def _need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        raise UserError(f"--launcher slurm: {tool!r} not found on PATH (run on a slurm login node)")
    return path


def active_array_tasks(job_id: str) -> set[int] | None:
    """Array task ids of ``job_id`` still queued or running; None when squeue does not know it."""
    proc = subprocess.run([_need("squeue"), "-h", "-r", "-j", job_id, "-o", "%i"], capture_output=True, text=True)
    if proc.returncode != 0:
        return None
    tails = (line.rsplit("_", 1)[-1] for line in proc.stdout.split() if "_" in line)
    return {int(t) for t in tails if t.isdigit()}


def slurm_jobs(sweep: Sweep) -> list[dict]:
    """``OUT/slurm/jobs.jsonl``: one ``{job_id, time, tasks, runs: {index: name}, cmd}`` per submission."""
    path = sweep.out / "slurm" / "jobs.jsonl"
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def slurm_active(sweep: Sweep) -> dict[str, str]:
    """Run name -> job id of the runs whose array task is still queued or running (squeue)."""
    active: dict[str, str] = {}
    for job in slurm_jobs(sweep):
        for i in active_array_tasks(str(job["job_id"])) or ():
            name = job.get("runs", {}).get(str(i))
            if name is not None:
                active[name] = str(job["job_id"])
    return active


def write_task(tasks: Path, run: Run, index: int) -> None:
    """``task_<i>.args`` (config, run dir, one override per line) and, when the run has one,
    ``task_<i>.after`` (the ``megaloop`` verb's arguments, one per line)."""
    for x in [run.config, str(run.run_dir), *run.overrides, *run.after]:
        if "\n" in x:
            raise UserError(f"{run.name}: {x!r}: newlines are not supported with --launcher slurm")
    (tasks / f"task_{index}.args").write_text("\n".join([run.config, str(run.run_dir), *run.overrides]) + "\n")
    if run.after:
        (tasks / f"task_{index}.after").write_text("\n".join(run.after) + "\n")


def sbatch_command(sweep: Sweep, indices: list[int], launch: Launch) -> list[str]:
    array = compress_indices(indices) + (f"%{launch.parallel}" if launch.parallel else "")
    return ["sbatch", "--parsable", f"--array={array}", f"--job-name={sweep.tag}-{sweep.out.name}",
            f"--chdir={Path.cwd()}", "--export=ALL", f"--output={sweep.out / 'slurm' / '%A_%a.out'}",
            *launch.sbatch_args, str(ARRAY_SCRIPT)]


def submit(sweep: Sweep, todo: list[Run], launch: Launch) -> str | None:
    """One array job over ``todo``. Each submission has its own ``OUT/slurm/sub<k>/`` of task files
    (``SWEEP_TASKS``), so a later plan (indices shift) never changes what a queued task reads."""
    indices = [sweep.index(r) for r in todo]
    cmd = sbatch_command(sweep, indices, launch)
    if launch.dry_run:
        sweep.log(f"would run: SWEEP_DIR={sweep.out} {shlex.join(cmd)}")
        for i, r in zip(indices, todo):
            then = f"; then megaloop {shlex.join(r.after)}" if r.after else ""
            sweep.log(f"  task {i} {r.name}: megaloop train {shlex.join(r.train_args())}{then}")
        return None
    tasks = sweep.out / "slurm" / f"sub{len(slurm_jobs(sweep)):03d}"
    tasks.mkdir(parents=True, exist_ok=True)
    for i, r in zip(indices, todo):
        write_task(tasks, r, i)
    cmd[0] = _need("sbatch")
    env = {**os.environ, "SWEEP_DIR": str(sweep.out), "SWEEP_TASKS": str(tasks), "SWEEP_EXIT_FILE": sweep.exit_file,
           "MEGALOOP_ROOT": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SubmitError(f"sbatch failed (exit {proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    job_id = proc.stdout.strip().split(";")[0].strip()
    if not job_id:
        raise SubmitError(f"sbatch printed no job id: {proc.stdout!r}")
    with open(sweep.out / "slurm" / "jobs.jsonl", "a") as f:
        f.write(json.dumps({"job_id": job_id, "time": now(), "tasks": str(tasks),
                            "runs": {str(i): r.name for i, r in zip(indices, todo)}, "cmd": cmd}) + "\n")
    for i, r in zip(indices, todo):
        sweep.record_launch(r, "slurm", cmd, job_id=job_id, array_index=i)
    sweep.log(f"submitted array job {job_id} ({len(todo)} run(s): --array={compress_indices(indices)}); "
              f"logs in {sweep.out / 'slurm'}")
    return job_id


def wait_slurm(sweep: Sweep, poll: float, jobs: list[str]) -> None:
    """Poll squeue until no task of the sweep is queued or running."""
    last = None
    while True:
        active = slurm_active(sweep)
        if not active:
            if jobs:
                sweep.log(f"job {', '.join(jobs)}: no task left in the queue")
            return
        if active != last:
            sweep.log(f"{len(active)} run(s) queued or running: {', '.join(sorted(active))}")
            last = active
        time.sleep(poll)


# ----------------------------------------------------------------------------- the whole pass
def pending(sweep: Sweep, active: dict[str, str], finished: Callable[[Run], str | None]) -> list[Run]:
    """The runs to launch: those ``finished`` gives no reason to skip (e.g. ``"done (step 6)"``)
    and that are not queued or running in slurm (``active``)."""
    todo = []
    for run in sweep.runs:
        reason = finished(run)
        if reason is None and run.name in active:
            reason = f"still queued/running in slurm job {active[run.name]}"
        if reason is None:
            todo.append(run)
        else:
            sweep.log(f"skip {run.name}: {reason}")
    return todo


def execute(sweep: Sweep, todo: list[Run], launch: Launch, active: dict[str, str],
            on_exit: Callable[[Run, int], None] | None = None) -> tuple[int, dict[str, str]]:
    """Run (or, dry, print) ``todo``; returns the exit status so far (130: interrupted) and the runs
    still in slurm. ``sbatch`` failures raise :class:`SubmitError`."""
    if launch.dry_run:
        if launch.launcher == "slurm" and todo:
            submit(sweep, todo, launch)
        for r in todo if launch.launcher == "local" else ():
            steps = ([megaloop_command(["train", *r.train_args()], launch.nproc)] if r.train else []) + \
                ([megaloop_command(r.after)] if r.after else [])
            sweep.log("would run: " + "; then ".join(map(shlex.join, steps)))
        return 0, active
    if launch.collect:
        return 0, active
    active = dict(active)
    try:
        if launch.launcher == "local":
            if todo:
                LocalPool(sweep, launch, on_exit).run(todo)
            return 0, active
        job = submit(sweep, todo, launch) if todo else None
        active.update({r.name: job for r in todo if job})
        if launch.wait:
            wait_slurm(sweep, launch.poll, sorted(set(active.values())))
            return 0, {}
        if active:
            sweep.log("not waiting (--wait not given): rerun this command, or add --collect, when the jobs are done")
    except KeyboardInterrupt:
        if launch.launcher == "slurm":
            sweep.log("stopped waiting; the slurm jobs keep running (rerun to collect)")
        return 130, active
    return 0, active


def run_cli(prog: str, parser: argparse.ArgumentParser, body: Callable[[argparse.Namespace, list[str]], int],
            argv: list[str] | None) -> int:
    """``main`` of a sweep command: parse ``argv`` (dotlist overrides for every run after ``--``),
    check ``--out``'s shape (also for ``--dry-run``) and run ``body(args, overrides)``, which probes that a
    file can be created there (after checking that it lies outside the datasets, where it has any); a :class:`UserError`
    is one line and exit 2, a refused submission one line and exit 1."""
    argv = list(sys.argv[1:] if argv is None else argv)
    extras: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extras = argv[:cut], argv[cut + 1:]
    args = parser.parse_args(argv)
    try:
        check_out_dir(getattr(args, "out", None), probe=False)  # the body probes it after the dataset check
        return body(args, extras)
    except UserError as err:
        return report(err, prog)
    except SubmitError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 1
