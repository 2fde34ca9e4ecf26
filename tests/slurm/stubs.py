"""Stand-ins for srun / scontrol / sbatch / squeue / torchrun that record their argv.

Each stub appends one JSON line ``{"name", "argv", "env", ...}`` to ``$STUB_LOG``.

* ``srun``: runs its command once per node (``--nodes=N``) with that task's ``SLURM_NODEID`` /
  ``SLURM_PROCID`` set, forwards SIGUSR1/SIGTERM to the tasks (as srun does) and exits with the
  first non-zero task status.
* ``torchrun``: records and then, per ``$STUB_TORCHRUN`` (default ``exit:0``), exits with that
  status; with ``worker:N`` node 0 writes N to ``$MEGALOOP_EXIT_STATUS_FILE`` (as the trainer's rank 0
  does) and every node exits 1 (as torchrun does when a worker exits non-zero); or with ``wait`` writes ``$STUB_DIR/ready.<node>`` and waits for SIGUSR1/SIGTERM (then
  records ``got_signal`` and exits 1, as torchrun does when its workers stop on a signal; ``wait:N``: node 0
  first writes the trainer's status N, as with ``worker:N``; ``$STUB_LINGER`` seconds pass between the first
  signal and the exit). With ``$STUB_CHECKPOINT`` (a run's ``checkpoints/latest``) node 0 first writes a new
  step name there, as a run that saved a checkpoint does.
* ``scontrol``: ``show hostnames`` prints ``$STUB_HOSTS`` (space separated); ``show job ID`` prints a
  job record whose ``Command=`` is ``$STUB_JOB_COMMAND`` (the script sbatch was given), nothing when unset;
  anything else is only recorded (``requeue`` included).
* ``sbatch``: prints ``$STUB_JOB_ID`` (default 777). ``squeue``: prints ``$STUB_DIR/squeue.out``.

``repo_copy`` copies slurm/ into a temporary "repository" for tests of where a job writes.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

_COMMON = r'''
import json, os, signal, subprocess, sys, time
KEEP = ("CUDA_DEVICE_MAX_CONNECTIONS", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "SCREEN_DIR",
        "MEGALOOP_ROOT", "SCREEN_POINTS_DIR", "SLURM_NODEID", "SLURM_PROCID", "WANDB_MODE", "WANDB_PROJECT", "PYTHONUNBUFFERED",
        "SWEEP_DIR", "SWEEP_TASKS", "SWEEP_EXIT_FILE")
def record(name, **extra):
    rec = {"name": name, "argv": sys.argv[1:], "cwd": os.getcwd(),
           "env": {k: os.environ[k] for k in KEEP if k in os.environ}, **extra}
    with open(os.environ["STUB_LOG"], "a") as f:
        f.write(json.dumps(rec) + "\n")
'''

_SRUN = _COMMON + r'''
record("srun")
args = sys.argv[1:]
i = 0
opts = {}
while i < len(args) and args[i].startswith("-"):
    k, _, v = args[i].partition("=")
    opts[k] = v
    i += 1
cmd = args[i:]
nodes = int(opts.get("--nodes", "1"))
hosts = os.environ.get("STUB_HOSTS", "node1").split()
procs = []
def forward(signum, _frame):
    for p in procs:
        try:
            p.send_signal(signum)
        except ProcessLookupError:
            pass
signal.signal(signal.SIGUSR1, forward)
signal.signal(signal.SIGTERM, forward)
for n in range(nodes):
    env = dict(os.environ, SLURM_NODEID=str(n), SLURM_PROCID=str(n), SLURMD_NODENAME=hosts[n % len(hosts)])
    procs.append(subprocess.Popen(cmd, env=env))
codes = []
for p in procs:
    while True:
        try:
            codes.append(p.wait())
            break
        except InterruptedError:
            continue
sys.exit(next((c for c in codes if c), 0))
'''

_TORCHRUN = _COMMON + r'''
mode = os.environ.get("STUB_TORCHRUN", "exit:0")
node = os.environ.get("SLURM_NODEID", "?")
got = []
def handler(signum, _frame):
    got.append(signal.Signals(signum).name)
signal.signal(signal.SIGUSR1, handler)
signal.signal(signal.SIGTERM, handler)
record("torchrun", node=node)
if os.environ.get("STUB_CHECKPOINT") and node == "0":
    os.makedirs(os.path.dirname(os.environ["STUB_CHECKPOINT"]), exist_ok=True)
    with open(os.environ["STUB_CHECKPOINT"], "w") as f:
        f.write(f"step_{time.time_ns()}\n")
if mode == "wait" or mode.startswith("wait:"):
    open(os.path.join(os.environ["STUB_DIR"], f"ready.{node}"), "w").close()
    t0 = time.time()
    while not got and time.time() - t0 < 60:
        time.sleep(0.05)
    time.sleep(float(os.environ.get("STUB_LINGER", "0")))  # a checkpoint being written: more signals may come
    record("torchrun-exit", node=node, got_signal=got)
    if mode.startswith("wait:") and node == "0":
        with open(os.environ["MEGALOOP_EXIT_STATUS_FILE"], "w") as f:
            f.write(mode.split(":", 1)[1] + "\n")
    sys.exit(1)
if mode.startswith("worker:"):
    if node == "0":
        with open(os.environ["MEGALOOP_EXIT_STATUS_FILE"], "w") as f:
            f.write(mode.split(":", 1)[1] + "\n")
    sys.exit(1)
sys.exit(int(mode.split(":", 1)[1]))
'''

_SCONTROL = _COMMON + r'''
record("scontrol")
if sys.argv[1:3] == ["show", "hostnames"]:
    print("\n".join(os.environ.get("STUB_HOSTS", "node1").split()))
elif sys.argv[1:3] == ["show", "job"] and os.environ.get("STUB_JOB_COMMAND"):
    print(f"JobId={sys.argv[3]} JobName=megaloop\n   UserId=me(1000) GroupId=me(1000)\n"
          f"   Command={os.environ['STUB_JOB_COMMAND']}\n   WorkDir={os.getcwd()}")
'''

_SBATCH = _COMMON + r'''
record("sbatch")
print(os.environ.get("STUB_JOB_ID", "777"))
'''

_SQUEUE = _COMMON + r'''
record("squeue")
path = os.path.join(os.environ["STUB_DIR"], "squeue.out")
if os.path.exists(path):
    sys.stdout.write(open(path).read())
'''

STUBS = {"srun": _SRUN, "torchrun": _TORCHRUN, "scontrol": _SCONTROL, "sbatch": _SBATCH,
         "squeue": _SQUEUE}


def install_stubs(directory: Path) -> Path:
    """Write the stub executables into ``directory/bin``; returns that bin directory."""
    bin_dir = directory / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, body in STUBS.items():
        path = bin_dir / name
        path.write_text(f"#!{sys.executable}\n{body}")
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return bin_dir


def stub_env(directory: Path, **extra: str) -> dict:
    """A clean environment (no real SLURM_* variables) with the stubs first on PATH."""
    bin_dir = install_stubs(directory)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SBATCH_", "MEGALOOP_ROOT", "STUB_"))
           and k not in ("MASTER_ADDR", "MASTER_PORT", "NODES", "TP", "PP", "VPP", "RUN_DIR",
                         "DATA_PATH", "VAL_PATH", "EXTRA_ARGS", "GPUS_PER_NODE", "VENV", "LOG_DIR",
                         "IDLE_REQUEUES")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", STUB_LOG=str(directory / "calls.jsonl"),
               STUB_DIR=str(directory))
    env.update(extra)
    return env


def repo_copy(directory: Path, name: str = "repo") -> Path:
    """``directory/name`` holding a copy of the repository's slurm/ scripts: run as MEGALOOP_ROOT, a
    job cds there and writes there whatever a script does wrong, never into the repository."""
    from tests.conftest import ROOT

    repo = directory / name
    (repo / "slurm").mkdir(parents=True, exist_ok=True)
    for script in (ROOT / "slurm").glob("*.sh"):
        (repo / "slurm" / script.name).write_text(script.read_text())
    return repo


def calls(directory: Path, name: str | None = None) -> list[dict]:
    path = directory / "calls.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [r for r in rows if name is None or r["name"] == name]


def run_script(script: str, env: dict, expect: int, timeout: int = 60, args: tuple = ()):
    """``bash slurm/SCRIPT ARGS`` in ``env`` (from :func:`stub_env`), run in its STUB_DIR; asserts the exit status."""
    import subprocess

    from tests.conftest import ROOT

    proc = subprocess.run(["bash", str(ROOT / "slurm" / script), *args], env=env, cwd=env["STUB_DIR"],
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == expect, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def fake_venv(tmp: Path, put_python) -> Path:
    """A venv launch/_setup.sh accepts as installed: ``put_python(bin_dir)`` writes its python, torchrun
    is the stub."""
    import hashlib

    from tests.conftest import ROOT

    venv = tmp / "venv"
    (venv / "bin").mkdir(parents=True)
    stubs = install_stubs(tmp)
    put_python(venv / "bin")
    (venv / "bin" / "torchrun").symlink_to(stubs / "torchrun")
    want = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + (ROOT / "launch" / "constraints.txt").read_bytes())
    (venv / ".megaloop-install-stamp").write_text(want.hexdigest() + "\n")
    return venv
