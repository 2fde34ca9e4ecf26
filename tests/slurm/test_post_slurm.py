"""slurm/rl.sh and slurm/distill.sh under simulated SLURM (stub srun/scontrol/torchrun, tests/slurm/stubs.py):
one torchrun per node running the post-training command under DeepSpeed, resume when a checkpoint exists,
requeue on the command's exit 75 (a checkpoint after slurm's USR1 warning)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.slurm.stubs import calls, repo_copy, run_script, stub_env

HOSTS = "gpu-a01 gpu-a02"


def _env(tmp: Path, **extra: str) -> dict:
    env = stub_env(tmp, STUB_HOSTS=HOSTS, SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="gpu-a[01-02]",
                   SLURM_NNODES="2", SLURM_NODEID="0", SLURM_SUBMIT_DIR=str(ROOT), VENV="none",
                   LOG_DIR=str(tmp / "logs"), OUT=str(tmp / "out"))
    env.update(extra)
    return env


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def _check_launch(tmp: Path, command: str) -> list[list[str]]:
    (srun,) = calls(tmp, "srun")
    assert "--nodes=2" in srun["argv"] and "--ntasks=2" in srun["argv"] and "--ntasks-per-node=1" in srun["argv"]
    assert "--nodelist=gpu-a01,gpu-a02" in srun["argv"] and "--kill-on-bad-exit=1" in srun["argv"]
    tr = sorted(calls(tmp, "torchrun"), key=lambda r: r["node"])
    assert [r["node"] for r in tr] == ["0", "1"]
    cmds = []
    for rank, rec in enumerate(tr):
        argv = rec["argv"]
        assert _flag(argv, "--node_rank") == str(rank) and _flag(argv, "--nnodes") == "2"
        assert _flag(argv, "--nproc_per_node") == "4"
        assert _flag(argv, "--rdzv_endpoint") == f"gpu-a01:{20000 + 4242 % 20000}"
        cmd = argv[argv.index("-m"):]
        assert cmd[:3] == ["-m", "megaloop.cli", command]
        assert _flag(cmd, "--out") == str(tmp / "out")
        cmds.append(cmd)
    assert (tmp / "logs" / "4242" / "exit_code").read_text().strip() == "0"
    assert "--node_rank $SLURM_NODEID" in (tmp / "logs" / "4242" / "launch.txt").read_text()
    return cmds


def test_rl_two_nodes(tmp_path: Path) -> None:
    env = _env(tmp_path, MODEL="/ckpt/hf/S", GPUS_PER_NODE="4", TASK="mbpp:tiny",
               EXTRA_ARGS="--arm recompute --steps 7")
    run_script("rl.sh", env, expect=0)
    for cmd in _check_launch(tmp_path, "rl"):
        assert _flag(cmd, "--model") == "/ckpt/hf/S" and _flag(cmd, "--task") == "mbpp:tiny"
        assert _flag(cmd, "--deepspeed") == "zero2" and _flag(cmd, "--save-every") == "50"
        assert _flag(cmd, "--arm") == "recompute" and _flag(cmd, "--steps") == "7"
        assert "--resume" not in cmd


def test_distill_resumes_when_a_checkpoint_exists(tmp_path: Path) -> None:
    (tmp_path / "out" / "checkpoints").mkdir(parents=True)
    (tmp_path / "out" / "checkpoints" / "latest").write_text("step000200")
    env = _env(tmp_path, TEACHER="/ckpt/hf/L", GPUS_PER_NODE="4", DATA="/data/val.jsonl", DS_CONFIG="zero2")
    run_script("distill.sh", env, expect=0)
    for cmd in _check_launch(tmp_path, "distill-prefill"):
        assert _flag(cmd, "--teacher") == "/ckpt/hf/L" and _flag(cmd, "--data") == "/data/val.jsonl"
        assert _flag(cmd, "--deepspeed") == "zero2" and "--resume" in cmd


def test_a_requeued_overwrite_job_resumes_its_checkpoint(tmp_path: Path) -> None:
    """README: EXTRA_ARGS=--overwrite restarts a run that stopped before its first checkpoint. Once that job
    checkpointed and was requeued (same EXTRA_ARGS), it got --resume --overwrite, which the command refuses
    (exit 2): the job was never resumed. With a checkpoint there, --overwrite is not passed."""
    env = _env(tmp_path, MODEL="/ckpt/hf/S", GPUS_PER_NODE="4", TASK="mbpp:tiny", EXTRA_ARGS="--overwrite --steps 7")
    run_script("rl.sh", env, expect=0)
    for cmd in _check_launch(tmp_path, "rl"):
        assert "--overwrite" in cmd and "--resume" not in cmd  # no checkpoint yet: the restart
    (tmp_path / "out" / "checkpoints").mkdir(parents=True)
    (tmp_path / "out" / "checkpoints" / "latest").write_text("step000050")
    (tmp_path / "calls.jsonl").unlink()  # the stubs' record of the first job
    proc = run_script("rl.sh", env, expect=0)
    for cmd in _check_launch(tmp_path, "rl"):
        assert "--resume" in cmd and "--overwrite" not in cmd and _flag(cmd, "--steps") == "7"
    assert "holds a checkpoint: resuming it; EXTRA_ARGS' --overwrite" in proc.stdout + proc.stderr


def test_failures_and_bad_knobs(tmp_path: Path) -> None:
    proc = run_script("rl.sh", _env(tmp_path), expect=2)
    assert "MODEL is not set" in proc.stderr
    proc = run_script("distill.sh", _env(tmp_path), expect=2)
    assert "TEACHER is not set" in proc.stderr
    proc = run_script("rl.sh", _env(tmp_path, MODEL="m", SAVE_EVERY="x"), expect=2)
    assert "SAVE_EVERY" in proc.stderr
    (tmp_path / "f").mkdir()
    env = _env(tmp_path / "f", MODEL="m", STUB_TORCHRUN="exit:3")
    run_script("rl.sh", env, expect=3)
    assert (tmp_path / "f" / "logs" / "4242" / "exit_code").read_text().strip() == "3"


def test_relative_paths_are_relative_to_the_submission_directory(tmp_path: Path) -> None:
    """`cd work; MEGALOOP_ROOT=REPO MODEL=hf/S OUT=out ... sbatch REPO/slurm/rl.sh`: the job runs in the
    repository (a copy here), the paths it is given name work/..., logs/ is work/logs."""
    repo, work = repo_copy(tmp_path), tmp_path / "work"
    (work / "out" / "checkpoints").mkdir(parents=True)
    (work / "out" / "checkpoints" / "latest").write_text("step000050")
    base = dict(STUB_HOSTS=HOSTS, SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="gpu-a[01-02]", SLURM_NNODES="2",
                SLURM_NODEID="0", SLURM_SUBMIT_DIR=str(work), VENV="none", MEGALOOP_ROOT=str(repo),
                GPUS_PER_NODE="4")
    env = stub_env(tmp_path, **base, MODEL="hf/S", OUT="out", TASK="gsm8k:data/gsm8k.jsonl", DS_CONFIG="ds/z1.json",
                   EXTRA_ARGS="--tokenizer tok/tokenizer.json --arm bptt --task=exact:p.jsonl")
    proc = subprocess.run(["bash", str(repo / "slurm" / "rl.sh")], env=env, cwd=work, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rec in calls(tmp_path, "torchrun"):
        cmd = rec["argv"][rec["argv"].index("-m"):]
        assert rec["cwd"] == str(repo)
        assert _flag(cmd, "--model") == str(work / "hf" / "S") and _flag(cmd, "--out") == str(work / "out")
        assert _flag(cmd, "--task") == f"gsm8k:{work}/data/gsm8k.jsonl"
        assert _flag(cmd, "--deepspeed") == str(work / "ds" / "z1.json")
        assert _flag(cmd, "--tokenizer") == str(work / "tok" / "tokenizer.json") and _flag(cmd, "--arm") == "bptt"
        assert cmd[-1] == f"--task=exact:{work}/p.jsonl"  # EXTRA_ARGS come last, so this --task wins
        assert "--resume" in cmd  # work/out/checkpoints/latest, not the repository's
    assert (work / "logs" / "4242" / "exit_code").read_text().strip() == "0"
    assert not (repo / "logs").exists()

    (tmp_path / "d").mkdir()
    env = stub_env(tmp_path / "d", **base, TEACHER="ckpt/L", DATA="val.jsonl",
                   EXTRA_ARGS="--tokenizer=tok --depth 5 --tokenizer bytes")
    proc = subprocess.run(["bash", str(repo / "slurm" / "distill.sh")], env=env, cwd=work, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rec in calls(tmp_path / "d", "torchrun"):
        cmd = rec["argv"][rec["argv"].index("-m"):]
        assert _flag(cmd, "--teacher") == str(work / "ckpt" / "L") and _flag(cmd, "--data") == str(work / "val.jsonl")
        assert _flag(cmd, "--out") == str(work / "students" / "distill") and _flag(cmd, "--deepspeed") == "zero3"
        assert f"--tokenizer={work}/tok" in cmd and _flag(cmd, "--depth") == "5" and cmd[-2:] == ["--tokenizer", "bytes"]


@pytest.mark.parametrize("script", ["rl.sh", "distill.sh"])
def test_preemption_signal_and_requeue(tmp_path: Path, script: str) -> None:
    """Both scripts ask for slurm's USR1 warning and are requeue-able; the command's own 75 (rank 0's
    status file: torchrun reports any failed worker as 1) requeues the job, as for slurm/train_*.sh."""
    head = [line.strip() for line in (ROOT / "slurm" / script).read_text().splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --signal=B:USR1@120" in head and "#SBATCH --requeue" in head
    knob = {"MODEL": "/ckpt/hf/S"} if script == "rl.sh" else {"TEACHER": "/ckpt/hf/L"}
    run_script(script, _env(tmp_path, **knob, GPUS_PER_NODE="4", STUB_TORCHRUN="worker:75"), expect=75)
    assert ["requeue", "4242"] in [c["argv"] for c in calls(tmp_path, "scontrol")]
    assert (tmp_path / "logs" / "4242" / "exit_code").read_text().strip() == "75"
    (tmp_path / "int").mkdir()
    env = _env(tmp_path / "int", **knob, GPUS_PER_NODE="4", STUB_TORCHRUN="worker:130")  # Ctrl-C: no requeue
    run_script(script, env, expect=130)
    assert not [c for c in calls(tmp_path / "int", "scontrol") if c["argv"][:1] == ["requeue"]]


def test_script_arguments_are_refused(tmp_path: Path) -> None:
    """`sbatch slurm/rl.sh --steps 500` ran the default arm for the default steps without a word (exit 0);
    options go in EXTRA_ARGS, as the refusal says, and nothing starts."""
    for script, knob in (("rl.sh", {"MODEL": "/ckpt/hf/S"}), ("distill.sh", {"TEACHER": "/ckpt/hf/L"})):
        proc = run_script(script, _env(tmp_path, **knob), expect=2, args=("--steps", "5"))
        assert proc.stderr.strip().splitlines()[-1].startswith("megaloop-slurm: error: unknown argument '--steps' "
                                                                "(settings are environment knobs: EXTRA_ARGS=")
    assert not calls(tmp_path, "srun")


def test_a_job_that_never_checkpoints_stops_requeueing(tmp_path: Path) -> None:
    """Every start stopped in set-up (the USR1 warning before the first step: exit 75, no checkpoint) was
    requeued for ever; IDLE_REQUEUES (2) requeues in a row may write none, the next one is not requeued,
    and a start that writes a checkpoint starts the count again."""
    latest = tmp_path / "out" / "checkpoints" / "latest"

    def start(expect_requeue: bool, **extra: str) -> str:
        before = len([c for c in calls(tmp_path, "scontrol") if c["argv"][:1] == ["requeue"]])
        extra = {"SLURM_RESTART_COUNT": "1", **extra}  # a requeued start (a first one starts the count afresh)
        proc = run_script("rl.sh", _env(tmp_path, MODEL="/ckpt/hf/S", GPUS_PER_NODE="4",
                                        STUB_TORCHRUN="worker:75", **extra), expect=75)
        after = len([c for c in calls(tmp_path, "scontrol") if c["argv"][:1] == ["requeue"]])
        assert after == before + expect_requeue, proc.stdout + proc.stderr
        return proc.stdout + proc.stderr

    assert "idle_requeues" not in start(True)  # no stray line about the count's file, which is not there yet
    start(True)
    out = start(False)
    assert "not requeued: the last 3 start(s) in a row stopped without a new checkpoint in " + str(latest.parent) in out
    assert "IDLE_REQUEUES=2" in out
    start(True, STUB_CHECKPOINT=str(latest))  # progress: requeued, and the count starts again
    start(True)
    start(True)
    start(False)
    start(True, SLURM_RESTART_COUNT="0")  # a first start (a job id used again) carries no count over
    (tmp_path / "z").mkdir()
    env = _env(tmp_path / "z", MODEL="/ckpt/hf/S", STUB_TORCHRUN="worker:75", IDLE_REQUEUES="0")
    assert "not requeued: the last 1 start(s)" in run_script("rl.sh", env, expect=75).stdout
    proc = run_script("rl.sh", dict(env, IDLE_REQUEUES="-1"), expect=2)
    assert "IDLE_REQUEUES must be a non-negative integer, got '-1'" in proc.stderr


def test_venv_and_log_dir_that_cannot_be_used_are_named(tmp_path: Path) -> None:
    """A VENV that is not there ran the job with whatever python came first on PATH (exit 0, no word); a
    LOG_DIR that cannot be made was mkdir's own message and exit 1. Both are one line naming the knob."""
    proc = run_script("rl.sh", _env(tmp_path, MODEL="m", VENV=str(tmp_path / "typo")), expect=2)
    assert proc.stderr.strip() == (f"megaloop-slurm: error: VENV={tmp_path / 'typo'} is not a virtual environment "
                                   "(no bin/activate); VENV=none uses the PATH's python")
    (tmp_path / "afile").write_text("")
    proc = run_script("distill.sh", _env(tmp_path, TEACHER="t", LOG_DIR=str(tmp_path / "afile")), expect=2)
    assert proc.stderr.strip() == (f"megaloop-slurm: error: LOG_DIR={tmp_path / 'afile'}: cannot create the writable "
                                   f"folder {tmp_path / 'afile' / '4242'} (the job's logs)")
    assert not calls(tmp_path, "srun")


def test_a_refused_resume_says_how_to_start_afresh_under_the_script(tmp_path: Path) -> None:
    """The command's refusal of changed settings on --resume suggests --overwrite, which the script drops
    while OUT holds a checkpoint; the job's log says what works under it."""
    (tmp_path / "out" / "checkpoints").mkdir(parents=True)
    (tmp_path / "out" / "checkpoints" / "latest").write_text("step000050")
    proc = run_script("rl.sh", _env(tmp_path, MODEL="m", STUB_TORCHRUN="worker:2"), expect=2)
    assert "if it refused changed settings: under this script a new OUT starts afresh" in proc.stdout + proc.stderr
