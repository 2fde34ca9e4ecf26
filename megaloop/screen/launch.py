"""LR screens, part 2: launching screen runs locally (subprocesses) or as a slurm array."""


import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


from megaloop.screen.core import (ROOT, Screen, UsageError, _finite, log, lr_tag, point_state)


# ====================================================================================== launchers
def _record_launch(screen: Screen, lr: float, launcher: str, cmd: list[str], **extra: Any) -> None:
    with open(screen.out / "launches.jsonl", "a") as f:
        f.write(json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "lr": lr, "launcher": launcher,
                            "cmd": cmd, **extra}) + "\n")


def local_command(screen: Screen, lr: float, nproc: int) -> list[str]:
    if nproc > 1:
        head = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={nproc}", "-m", "megaloop.cli", "train"]
    else:
        head = [sys.executable, "-m", "megaloop.cli", "train"]
    return [*head, *screen.train_args(lr)]


class _Stop(Exception):
    pass


def run_local(screen: Screen, todo: list[float], parallel: int, nproc: int,
              devices: list[str] | None) -> None:
    """Run the points as subprocesses, ``parallel`` at a time; Ctrl-C / SIGTERM checkpoint them."""
    if devices is not None and len(devices) < parallel * nproc:
        raise UsageError(f"--devices: {len(devices)} device(s) for --parallel {parallel} x --nproc {nproc}")
    queue = list(todo)
    running: dict[int, tuple[subprocess.Popen, float, float, Any]] = {}  # slot -> (proc, lr, t0, log)
    free = list(range(parallel))

    def on_term(signum, _frame):  # noqa: ANN001
        raise _Stop(signal.Signals(signum).name)

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        try:
            while queue or running:
                while queue and free:
                    slot, lr = free.pop(0), queue.pop(0)
                    run_dir = screen.run_dir(lr)
                    run_dir.mkdir(parents=True, exist_ok=True)
                    (run_dir / "screen_exit").unlink(missing_ok=True)
                    cmd = local_command(screen, lr, nproc)
                    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
                    if devices is not None:
                        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices[slot * nproc:(slot + 1) * nproc])
                    logf = open(run_dir / "train.log", "a")
                    logf.write(f"=== lr_screen {time.strftime('%Y-%m-%dT%H:%M:%S')}: {shlex.join(cmd)}\n")
                    logf.flush()
                    resumed = (run_dir / "checkpoints").exists()
                    log(f"launch lr={lr_tag(lr)}{' (resuming)' if resumed else ''} -> {run_dir}/train.log")
                    _record_launch(screen, lr, "local", cmd, resumed=resumed)
                    # own session: a terminal's Ctrl-C reaches only this tool, which then asks the
                    # runs to checkpoint (SIGTERM) instead of killing them mid-step.
                    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=logf, stderr=subprocess.STDOUT,
                                            start_new_session=True)
                    running[slot] = (proc, lr, time.time(), logf)
                time.sleep(0.2)
                for slot in list(running):
                    proc, lr, t0, logf = running[slot]
                    code = proc.poll()
                    if code is None:
                        continue
                    logf.close()
                    _finish(screen, lr, code, time.time() - t0)
                    del running[slot]
                    free.append(slot)
                    free.sort()
        except (KeyboardInterrupt, _Stop) as why:
            log(f"interrupted ({why or 'SIGINT'}): asking {len(running)} run(s) to checkpoint and stop")
            for proc, *_ in running.values():
                try:
                    proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
            for slot, (proc, lr, t0, logf) in running.items():
                try:
                    code = proc.wait(timeout=600)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    code = proc.wait()
                logf.close()
                _finish(screen, lr, code, time.time() - t0)
            raise KeyboardInterrupt from None
    finally:
        signal.signal(signal.SIGTERM, old)


def _finish(screen: Screen, lr: float, code: int, seconds: float) -> None:
    run_dir = screen.run_dir(lr)
    (run_dir / "screen_exit").write_text(f"{code}\n")
    st = point_state(run_dir, screen.end_step)
    ce = f" val_ce={st['val_ce']:.4f}" if _finite(st["val_ce"]) else ""
    log(f"lr={lr_tag(lr)} {st['status']} (exit {code}, step {st['steps']}/{screen.end_step}, "
        f"{seconds:.0f}s){ce}")
    if st["status"] == "failed":
        tail = (run_dir / "train.log").read_text(errors="replace").splitlines()[-8:]
        for line in tail:
            print(f"    | {line}", flush=True)


def compress_indices(idx: list[int]) -> str:
    """[0,1,2,5,7,8] -> '0-2,5,7-8' (sbatch --array syntax)."""
    parts, i = [], 0
    idx = sorted(idx)
    while i < len(idx):
        j = i
        while j + 1 < len(idx) and idx[j + 1] == idx[j] + 1:
            j += 1
        parts.append(str(idx[i]) if i == j else f"{idx[i]}-{idx[j]}")
        i = j + 1
    return ",".join(parts)


def _need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        raise UsageError(f"--launcher slurm: {tool!r} not found on PATH (run on a slurm login node)")
    return path


def active_array_tasks(job_id: str) -> set[int] | None:
    """Array task ids of ``job_id`` still queued or running; None when squeue does not know it."""
    proc = subprocess.run([_need("squeue"), "-h", "-r", "-j", job_id, "-o", "%i"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return None
    out: set[int] = set()
    for line in proc.stdout.split():
        tail = line.rsplit("_", 1)[-1] if "_" in line else ""
        if tail.isdigit():
            out.add(int(tail))
    return out


def slurm_jobs(screen: Screen) -> list[dict]:
    path = screen.out / "slurm" / "jobs.jsonl"
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def slurm_active(screen: Screen) -> dict[float, str]:
    """LR -> job id of points whose array task is still in squeue."""
    active: dict[float, str] = {}
    for job in slurm_jobs(screen):
        tasks = active_array_tasks(str(job["job_id"]))
        for i in tasks or ():
            lr = job["lrs"].get(str(i))
            if lr is not None:
                active[float(lr)] = str(job["job_id"])
    return active


def write_point_args(points_dir: Path, screen: Screen, lr: float, index: int) -> Path:
    """POINTS_DIR/point_<i>.args: config, run dir, then one override per line (read by mapfile)."""
    lines = [screen.config, str(screen.run_dir(lr)), *screen.point_overrides(lr)]
    for x in lines:
        if "\n" in x:
            raise UsageError(f"override {x!r}: newlines are not supported in slurm screens")
    path = points_dir / f"point_{index}.args"
    path.write_text("\n".join(lines) + "\n")
    return path


def sbatch_command(screen: Screen, indices: list[int], parallel: int | None, sbatch_args: list[str]) -> list[str]:
    array = compress_indices(indices) + (f"%{parallel}" if parallel else "")
    return ["sbatch", "--parsable", f"--array={array}",
            f"--job-name=lrscreen-{Path(screen.config).stem}", f"--chdir={ROOT}", "--export=ALL",
            f"--output={screen.out / 'slurm' / '%A_%a.out'}", *sbatch_args,
            str(ROOT / "slurm" / "lr_screen_array.sh")]


def run_slurm(screen: Screen, todo: list[float], parallel: int | None, sbatch_args: list[str],
              dry_run: bool) -> str | None:
    """Submit the unfinished points as one array job; array index = the point's index in the grid.

    Each submission gets its own ``OUT/slurm/sub<k>/point_<i>.args`` (exported to the job as
    ``SCREEN_POINTS_DIR``), so a grid extended later (indices shift) never changes what an
    already-queued task reads.
    """
    index = {lr: i for i, lr in enumerate(screen.lrs)}
    indices = [index[lr] for lr in todo]
    cmd = sbatch_command(screen, indices, parallel, sbatch_args)
    if dry_run:
        log(f"would run: SCREEN_DIR={screen.out} {shlex.join(cmd)}")
        for lr in todo:
            log(f"  point {index[lr]}: lr={lr_tag(lr)}: megaloop train {shlex.join(screen.train_args(lr))}")
        return None
    points_dir = screen.out / "slurm" / f"sub{len(slurm_jobs(screen)):03d}"
    points_dir.mkdir(parents=True, exist_ok=True)
    for lr in todo:
        write_point_args(points_dir, screen, lr, index[lr])
    cmd[0] = _need("sbatch")
    env = {**os.environ, "SCREEN_DIR": str(screen.out), "SCREEN_POINTS_DIR": str(points_dir),
           "MEGALOOP_ROOT": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"sbatch failed (exit {proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    job_id = proc.stdout.strip().split(";")[0].strip()
    if not job_id:
        raise RuntimeError(f"sbatch printed no job id: {proc.stdout!r}")
    with open(screen.out / "slurm" / "jobs.jsonl", "a") as f:
        f.write(json.dumps({"job_id": job_id, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                            "points_dir": str(points_dir), "lrs": {str(index[lr]): lr for lr in todo},
                            "cmd": cmd}) + "\n")
    for lr in todo:
        _record_launch(screen, lr, "slurm", cmd, job_id=job_id, array_index=index[lr])
    log(f"submitted array job {job_id} ({len(todo)} point(s): --array={compress_indices(indices)}); "
        f"logs in {screen.out / 'slurm'}")
    return job_id


def wait_slurm(job_id: str, poll: float) -> None:
    log(f"waiting for job {job_id} (squeue every {poll:g}s)")
    last = None
    while True:
        tasks = active_array_tasks(job_id)
        if not tasks:
            log(f"job {job_id}: no task left in the queue")
            return
        if tasks != last:
            log(f"job {job_id}: {len(tasks)} task(s) queued or running: {compress_indices(sorted(tasks))}")
            last = tasks
        time.sleep(poll)
