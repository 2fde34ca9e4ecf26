"""The knobs of slurm/*.sh and launch/train_single_node.sh against a config's own settings, and the
rendezvous knobs (stub srun / scontrol / torchrun from tests/slurm/stubs.py; no training):

* a knob is passed only where it is set, so a CONFIG file's parallel/data/logging settings stand (found: the
  knob defaults TP 1, PP 1, data.path=default, logging.wandb=offline overrode them), and the preflight plans
  what the launch runs;
* data.val_path=default:val only where the run trains on the embedded corpus (found: added beside an
  EXTRA_ARGS data.path, so the validation set was the embedded corpus's, of another tokenizer);
* a built-in preset / shipped DeepSpeed config is never a file or directory of that name in the submission
  directory (found: `mkdir L; sbatch slurm/train_L.sh` refused, a file `L` replaced the preset);
* GPUS_PER_NODE=0, a bad MASTER_PORT and a loopback MASTER_ADDR on several nodes: one line, exit 2.
"""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.slurm.stubs import calls, fake_venv, run_script, stub_env

HOSTS = "gpu-a01 gpu-a02"
# knobs the test runner's own environment may hold (WANDB_MODE=offline is usual): unset unless a test sets them
UNSET = ("WANDB_MODE", "WANDB_PROJECT", "WANDB_NAME", "CONFIG", "DS_CONFIG", "PREFLIGHT", "PLAN_CLUSTER",
         "SLURM_GPUS_ON_NODE", "NPROC", "MEGALOOP_VENV")
SCALE_KEYS = ("parallel.tp=", "parallel.pp=", "data.path=", "data.val_path=", "logging.wandb=", "logging.project=")


def _python_recording_plan(bin_dir: Path) -> None:
    """`python` first on PATH: `-m megaloop.cli plan ...` (the preflight) records its arguments in
    $STUB_DIR/plan_argv and says ok; anything else is this interpreter."""
    wrapper = bin_dir / "python"
    wrapper.write_text('#!/bin/sh\nif [ "$1 $2 $3" = "-m megaloop.cli plan" ]; then\n'
                       '  printf "%s\\n" "$@" >"$STUB_DIR/plan_argv"; echo "megaloop preflight: ok: (stub)"; exit 0\n'
                       f'fi\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)


def _env(tmp: Path, **extra: str) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    env = stub_env(tmp, STUB_HOSTS=HOSTS, SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="gpu-a[01-02]",
                   SLURM_NNODES="2", SLURM_NODEID="0", SLURM_SUBMIT_DIR=str(tmp), VENV="none",
                   LOG_DIR=str(tmp / "logs"), RUN_DIR=str(tmp / "run"), OUT=str(tmp / "out"))
    for key in UNSET:
        env.pop(key, None)
    env.update({"PREFLIGHT": "0", **extra})
    _python_recording_plan(tmp / "bin")
    return env


def _train_args(tmp: Path) -> list[str]:
    """The `-m megaloop.cli ...` part of node 0's torchrun (both nodes run the same)."""
    tr = calls(tmp, "torchrun")
    assert len(tr) >= 1
    argvs = {tuple(rec["argv"][rec["argv"].index("-m"):]) for rec in tr}
    assert len(argvs) == 1, argvs
    return list(argvs.pop())


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def _scale(argv: list[str]) -> list[str]:
    return [a for a in argv if a.startswith(SCALE_KEYS)]


def _one_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


# --- D1: the embedded validation set only beside the embedded training set --------------------------------

def test_extra_args_data_path_gets_no_embedded_validation_set(tmp_path: Path) -> None:
    """EXTRA_ARGS="data.path=..." without DATA_PATH (found: data.val_path=default:val added and the 'training on
    the small embedded corpus' warning; validation on another tokenizer's corpus)."""
    proc = run_script("train_L.sh", _env(tmp_path, EXTRA_ARGS="data.path=/lustre/mds optim.lr=4e-4"), expect=0)
    argv = _train_args(tmp_path)
    assert _scale(argv) == ["logging.wandb=offline", "data.path=/lustre/mds"], argv
    assert "embedded corpus" not in proc.stdout
    # a relative one (the submission directory's) likewise
    run_script("train_L.sh", _env(tmp_path / "rel", EXTRA_ARGS="data.path=mds"), expect=0)
    assert _scale(_train_args(tmp_path / "rel")) == ["logging.wandb=offline", f"data.path={tmp_path}/rel/mds"]


def test_a_config_or_preset_with_its_own_dataset_gets_no_embedded_validation_set(tmp_path: Path) -> None:
    """A CONFIG file (or the synth preset) training on its own data: no default:val beside it."""
    (tmp_path / "my.yaml").write_text(f"base: {ROOT}/megaloop/configs/S.yaml\ndata:\n  path: /lustre/mds\n")
    proc = run_script("train_S.sh", _env(tmp_path, CONFIG="my.yaml"), expect=0)
    assert _scale(_train_args(tmp_path)) == ["logging.wandb=offline"]
    assert "embedded corpus" not in proc.stdout
    run_script("train_S.sh", _env(tmp_path / "synth", CONFIG="synth"), expect=0)
    argv = _train_args(tmp_path / "synth")
    assert _flag(argv, "--config") == "synth" and _scale(argv) == ["logging.wandb=offline"]


def test_the_embedded_corpus_still_gets_its_validation_split(tmp_path: Path) -> None:
    """As documented: no DATA_PATH with a preset trains on the embedded corpus, validates on default:val,
    logs to wandb offline (and warns that it is a smoke test); a given VAL_PATH, or one in EXTRA_ARGS, wins."""
    proc = run_script("train_M.sh", _env(tmp_path), expect=0)
    assert _scale(_train_args(tmp_path)) == ["data.val_path=default:val", "logging.wandb=offline"]
    assert "training on the small embedded corpus" in proc.stdout
    assert {rec["env"].get("WANDB_MODE") for rec in calls(tmp_path, "torchrun")} == {"offline"}
    run_script("train_M.sh", _env(tmp_path / "x", EXTRA_ARGS="data.val_path=default:screen"), expect=0)
    assert _scale(_train_args(tmp_path / "x")) == ["logging.wandb=offline", "data.val_path=default:screen"]
    run_script("train_M.sh", _env(tmp_path / "v", DATA_PATH="default", VAL_PATH="/v"), expect=0)
    assert _scale(_train_args(tmp_path / "v")) == ["data.path=default", "data.val_path=/v", "logging.wandb=offline"]


# --- D2: a CONFIG file's own settings stand unless a knob is set -------------------------------------------

MY_L = f"""base: {ROOT}/megaloop/configs/L.yaml
parallel:
  tp: 2
  pp: 2
data:
  path: /lustre/mds
  val_path: /lustre/val
logging:
  wandb: online
  project: mine
"""


def test_a_config_files_settings_stand_and_the_preflight_plans_them(tmp_path: Path) -> None:
    """CONFIG=myL.yaml with parallel.tp/pp, data.path/val_path, logging.wandb/project (found: TP1 PP1 on the
    embedded corpus, offline, project megaloop); the preflight gets the same overrides as the launch."""
    (tmp_path / "myL.yaml").write_text(MY_L)
    run_script("train_L.sh", _env(tmp_path, CONFIG="myL.yaml", PREFLIGHT="1", PLAN_CLUSTER="h100"), expect=0)
    argv = _train_args(tmp_path)
    assert _flag(argv, "--config") == str(tmp_path / "myL.yaml")
    assert _scale(argv) == [], argv
    assert {rec["env"].get("WANDB_MODE") for rec in calls(tmp_path, "torchrun")} == {None}
    plan = (tmp_path / "plan_argv").read_text().splitlines()
    assert _flag(plan, "--config") == str(tmp_path / "myL.yaml")
    overrides = argv[argv.index("auto") + 1:]
    assert plan[-len(overrides):] == overrides, (plan, overrides)


def test_knobs_that_are_set_still_win_over_the_config(tmp_path: Path) -> None:
    (tmp_path / "myL.yaml").write_text(MY_L)
    run_script("train_L.sh", _env(tmp_path, CONFIG="myL.yaml", TP="4", PP="1", DATA_PATH="/d", VAL_PATH="/v",
                            WANDB_MODE="disabled", WANDB_PROJECT="p", PREFLIGHT="1"), expect=0)
    argv = _train_args(tmp_path)
    assert _scale(argv) == ["parallel.tp=4", "parallel.pp=1", "data.path=/d", "data.val_path=/v",
                            "logging.wandb=disabled", "logging.project=p"]
    assert {rec["env"].get("WANDB_MODE") for rec in calls(tmp_path, "torchrun")} == {"disabled"}
    plan = (tmp_path / "plan_argv").read_text().splitlines()
    assert _scale(plan) == _scale(argv)


def test_extra_args_logging_wandb_gets_no_offline_default(tmp_path: Path) -> None:
    run_script("train_S.sh", _env(tmp_path, EXTRA_ARGS="logging.wandb=online"), expect=0)
    assert _scale(_train_args(tmp_path)) == ["data.val_path=default:val", "logging.wandb=online"]


def test_an_unreadable_config_gets_no_defaults_over_it(tmp_path: Path) -> None:
    """Where the config cannot be read on the batch node (here: no megaloop for `python`), nothing is put over a
    CONFIG file's settings (a warning says so); the built-in preset keeps its documented defaults."""
    env = _env(tmp_path, CONFIG="myL.yaml")
    (tmp_path / "myL.yaml").write_text(MY_L)
    (tmp_path / "bin" / "python").write_text("#!/bin/sh\necho 'No module named megaloop' >&2\nexit 1\n")
    proc = run_script("train_L.sh", env, expect=0)
    assert _scale(_train_args(tmp_path)) == []
    assert "could not read CONFIG" in proc.stdout
    del env["CONFIG"]
    run_script("train_L.sh", dict(env, LOG_DIR=str(tmp_path / "logs2")), expect=0)
    argv = [a for a in calls(tmp_path, "torchrun")[-1]["argv"] if a.startswith(SCALE_KEYS)]
    assert argv == ["data.val_path=default:val", "logging.wandb=offline"]


# --- D3: built-in presets and shipped DeepSpeed configs are never the submission directory's files ----------

@pytest.mark.parametrize("kind", ["directory", "file"])
def test_the_scripts_own_preset_is_never_a_file_of_that_name(tmp_path: Path, kind: str) -> None:
    """`mkdir L; sbatch slurm/train_L.sh` (found: refused, "config file .../L is a directory") and a file `L`
    there (found: silently trained instead of the preset)."""
    if kind == "directory":
        (tmp_path / "L").mkdir(parents=True)
    else:
        tmp_path.mkdir(parents=True, exist_ok=True)
        (tmp_path / "L").write_text("model:\n  hidden_size: 64\n")
    run_script("train_L.sh", _env(tmp_path, PREFLIGHT="1", PLAN_CLUSTER="h100"), expect=0)
    assert _flag(_train_args(tmp_path), "--config") == "L"
    assert _flag((tmp_path / "plan_argv").read_text().splitlines(), "--config") == "L"


def test_a_given_config_name_still_prefers_the_file(tmp_path: Path) -> None:
    """A CONFIG the user gives: a file of that name in the submission directory wins (unchanged)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "mine").write_text(f"base: {ROOT}/megaloop/configs/S.yaml\n")
    run_script("train_S.sh", _env(tmp_path, CONFIG="mine"), expect=0)
    assert _flag(_train_args(tmp_path), "--config") == str(tmp_path / "mine")


@pytest.mark.parametrize(("script", "name", "required"), [("rl.sh", "zero2", "MODEL"),
                                                          ("distill.sh", "zero3", "TEACHER")])
def test_the_shipped_deepspeed_config_is_never_a_file_of_that_name(tmp_path: Path, script: str, name: str,
                                                                    required: str) -> None:
    (tmp_path / name).mkdir(parents=True)
    run_script(script, _env(tmp_path, **{required: "/ckpt/hf"}), expect=0)
    assert _flag(_train_args(tmp_path), "--deepspeed") == name
    (tmp_path / "given").mkdir()
    (tmp_path / "given" / "ds").write_text("{}")  # DS_CONFIG given: the submission directory's file
    run_script(script, _env(tmp_path / "given", **{required: "/ckpt/hf", "DS_CONFIG": "ds"}), expect=0)
    assert _flag(_train_args(tmp_path / "given"), "--deepspeed") == str(tmp_path / "given" / "ds")


# --- D4, D5: process count and rendezvous knobs --------------------------------------------------------------

def test_zero_gpus_per_node_is_refused(tmp_path: Path) -> None:
    """GPUS_PER_NODE=0 or SLURM_GPUS_ON_NODE=0 (found: torchrun --nproc_per_node 0)."""
    line = _one_line(run_script("train_S.sh", _env(tmp_path, GPUS_PER_NODE="0"), expect=2))
    assert line == "megaloop-slurm: error: GPUS_PER_NODE must be a positive integer, got '0'"
    line = _one_line(run_script("rl.sh", _env(tmp_path, SLURM_GPUS_ON_NODE="0", MODEL="/m"), expect=2))
    assert "SLURM_GPUS_ON_NODE" in line and "positive integer, got '0'" in line
    assert not calls(tmp_path, "srun")


@pytest.mark.parametrize("port", ["abc", "0", "65536", "123456789012", "29500x"])
def test_a_bad_master_port_is_refused(tmp_path: Path, port: str) -> None:
    line = _one_line(run_script("train_S.sh", _env(tmp_path, MASTER_PORT=port), expect=2))
    assert line.startswith("megaloop-slurm: error: MASTER_PORT must be a port number (1-65535), got ")
    assert not calls(tmp_path, "srun")


@pytest.mark.parametrize("addr", ["localhost", "127.0.0.1", "127.0.1.1", "::1"])
def test_a_loopback_master_addr_on_several_nodes_is_refused(tmp_path: Path, addr: str) -> None:
    """MASTER_ADDR=localhost carried from the submitting shell (sbatch --export=ALL): every node would host its
    own rendezvous and wait there until the timeout."""
    line = _one_line(run_script("train_S.sh", _env(tmp_path, MASTER_ADDR=addr), expect=2))
    assert f"MASTER_ADDR={addr}" in line and "unset MASTER_ADDR" in line and "gpu-a01" in line
    assert not calls(tmp_path, "srun")


def test_rendezvous_knobs_that_are_fine(tmp_path: Path) -> None:
    """One node at localhost, and a valid port: as given."""
    run_script("train_S.sh", _env(tmp_path, MASTER_ADDR="localhost", MASTER_PORT="29500", NODES="1"), expect=0)
    (tr,) = calls(tmp_path, "torchrun")
    assert _flag(tr["argv"], "--rdzv_endpoint") == "localhost:29500"
    run_script("train_S.sh", _env(tmp_path / "b", MASTER_ADDR="gpu-a02", MASTER_PORT="65535"), expect=0)
    assert {_flag(r["argv"], "--rdzv_endpoint") for r in calls(tmp_path / "b", "torchrun")} == {"gpu-a02:65535"}


# --- launch/train_single_node.sh: the same knob rules ---------------------------------------------------------

def _fake_venv(tmp: Path) -> Path:
    """A venv launch/_setup.sh accepts as installed: python records the preflight (else this interpreter)."""
    return fake_venv(tmp, _python_recording_plan)


def _single(tmp: Path, *args: str, expect: int = 0, **extra: str) -> list[str]:
    tmp.mkdir(parents=True, exist_ok=True)
    env = stub_env(tmp, MEGALOOP_VENV=str(_fake_venv(tmp)), NPROC="2", RUN_DIR=str(tmp / "run"),
                   PLAN_CLUSTER="h100")
    for key in UNSET:
        if key not in ("MEGALOOP_VENV", "NPROC", "PLAN_CLUSTER"):
            env.pop(key, None)
    env.update(extra)
    proc = subprocess.run(["bash", str(ROOT / "launch" / "train_single_node.sh"), *args], env=env, cwd=tmp,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == expect, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    (rec,) = calls(tmp, "torchrun")
    return rec["argv"][rec["argv"].index("-m"):]


def test_single_node_config_settings_stand(tmp_path: Path) -> None:
    """launch/train_single_node.sh passed parallel.tp=1 parallel.pp=1 logging.wandb=offline logging.project=megaloop
    over a CONFIG file's own."""
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "my.yaml").write_text(f"base: {ROOT}/megaloop/configs/tiny.yaml\nparallel:\n  tp: 2\n"
                                            "logging:\n  wandb: online\n  project: mine\n")
    argv = _single(tmp_path / "a", "train.max_steps=3", CONFIG="my.yaml")
    assert _scale(argv) == [] and argv[-1] == "train.max_steps=3"
    plan = (tmp_path / "a" / "plan_argv").read_text().splitlines()
    assert plan[-1] == "train.max_steps=3" and _scale(plan) == []
    # the knobs, when set, still win; the preset keeps its documented offline default
    argv = _single(tmp_path / "b", CONFIG="tiny", TP="2", WANDB_PROJECT="p")
    assert _scale(argv) == ["parallel.tp=2", "logging.wandb=offline", "logging.project=p"]
    argv = _single(tmp_path / "c", "logging.wandb=disabled")
    assert _scale(argv) == ["logging.wandb=disabled"]


def test_single_node_default_preset_is_never_a_file_of_that_name(tmp_path: Path) -> None:
    (tmp_path / "tiny").mkdir(parents=True)  # megaloop itself would take ./tiny for --config tiny
    argv = _single(tmp_path, PREFLIGHT="0")
    assert _flag(argv, "--config") == str(ROOT / "megaloop" / "configs" / "tiny.yaml")
    assert _flag(argv, "--run-dir") == str(tmp_path / "run")
