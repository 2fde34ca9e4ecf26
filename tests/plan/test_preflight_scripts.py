"""Preflight in slurm/train_*.sh and launch/train_single_node.sh (stub srun/scontrol/torchrun from
tests/slurm/stubs.py): a layout predicted not to fit exits 2 with one line before anything is
launched, and so does a configuration megaloop refuses (its exit 2); --no-preflight launches it; a
fitting layout logs the prediction; a planner that fails otherwise only warns (the trainer checks the
config itself). A relative PLAN_CLUSTER file is the submission directory's."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT
from tests.slurm.stubs import calls, fake_venv, stub_env

TOO_BIG = "train.micro_batch_size=64 train.global_batch_size=1024"


def _python_on_path(bin_dir: Path, body: str | None = None) -> None:
    """`python` = this interpreter (the stub bin dir is first on PATH; no real torchrun behind it), or
    a shell script of ``body``."""
    wrapper = bin_dir / "python"
    wrapper.write_text(f'#!/bin/sh\n{body}\n' if body else f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)


def _slurm(tmp: Path, *args: str, expect: int, python: str | None = None, **extra: str) -> subprocess.CompletedProcess:
    tmp.mkdir(parents=True, exist_ok=True)
    env = stub_env(tmp, STUB_HOSTS="gpu-a01 gpu-a02", SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="gpu-a[01-02]",
                   SLURM_NNODES="2", SLURM_NODEID="0", SLURM_SUBMIT_DIR=str(ROOT), VENV="none",
                   LOG_DIR=str(tmp / "logs"), RUN_DIR=str(tmp / "run"), **{"PLAN_CLUSTER": "h100", **extra})
    _python_on_path(tmp / "bin", python)
    proc = subprocess.run(["bash", str(ROOT / "slurm" / "train_L.sh"), *args], env=env, cwd=tmp,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == expect, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def test_slurm_refuses_a_layout_predicted_not_to_fit(tmp_path: Path) -> None:
    proc = _slurm(tmp_path, expect=2, EXTRA_ARGS=TOO_BIG)
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("megaloop preflight: refusing: predicted not to fit: L at TP1 PP1 DP16 mbs64")
    assert "of 79.6 GiB" in line and "--no-preflight" in line
    assert not calls(tmp_path, "srun") and not calls(tmp_path, "torchrun")


def test_slurm_no_preflight_launches_it(tmp_path: Path) -> None:
    _slurm(tmp_path, "--no-preflight", expect=0, EXTRA_ARGS=TOO_BIG)
    assert len(calls(tmp_path, "torchrun")) == 2
    for rec in calls(tmp_path, "torchrun"):
        assert "--no-preflight" not in rec["argv"] and "train.micro_batch_size=64" in rec["argv"]
    _slurm(tmp_path / "env", expect=0, EXTRA_ARGS=TOO_BIG, PREFLIGHT="0")


def test_slurm_fitting_layout_logs_the_prediction(tmp_path: Path) -> None:
    proc = _slurm(tmp_path, expect=0, TP="2", PP="2")
    assert "megaloop preflight: ok: L at TP2 PP2 DP4 mbs2 on 16 x H100-SXM5-80GB" in proc.stdout
    assert len(calls(tmp_path, "torchrun")) == 2


def test_slurm_refuses_a_configuration_megaloop_refuses(tmp_path: Path) -> None:
    """megaloop's exit 2 (bad input, the trainer's own rules): one line, exit 2, nothing launched (found:
    a warning, then srun of the whole allocation for every rank to exit 2)."""
    for sub, extra, field in (("typo", {"EXTRA_ARGS": "train.max_stpes=3"}, "train.max_stpes: unknown field"),
                              ("tp", {"TP": "3"}, "model.num_heads"),
                              ("vpp", {"PP": "2", "VPP": "2"}, "parallel.vpp"),
                              ("cluster", {"PLAN_CLUSTER": "nosuch.yaml"}, "PLAN_CLUSTER (--cluster): file")):
        proc = _slurm(tmp_path / sub, expect=2, **extra)
        (line,) = proc.stderr.strip().splitlines()
        assert line.startswith(f"megaloop preflight: refusing: megaloop plan: error: {field}"), line
        assert "launching anyway" not in proc.stdout
        assert not calls(tmp_path / sub, "srun") and not calls(tmp_path / sub, "torchrun")


def test_slurm_planner_failure_only_warns(tmp_path: Path) -> None:
    """Anything but megaloop's exit 2 (here a planner crash: a traceback, exit 1) warns and launches:
    the trainer validates the config itself."""
    crash = 'echo "Traceback (most recent call last):" >&2; echo "RuntimeError: simulation deadlocked" >&2; exit 1'
    proc = _slurm(tmp_path, expect=0, python=crash)
    assert ("megaloop preflight: warning: could not plan this layout (RuntimeError: simulation deadlocked); "
            "launching anyway") in proc.stdout
    assert len(calls(tmp_path, "torchrun")) == 2


def test_slurm_plan_cluster_file_relative_to_the_submission_directory(tmp_path: Path) -> None:
    (tmp_path / "cl").mkdir(parents=True)
    (tmp_path / "cl" / "mine.yaml").write_text((ROOT / "megaloop" / "plan" / "clusters" / "h100.yaml").read_text())
    proc = _slurm(tmp_path, expect=0, TP="2", PP="2", PLAN_CLUSTER="cl/mine.yaml")
    assert "megaloop preflight: ok: L at TP2 PP2 DP4 mbs2 on 16 x H100-SXM5-80GB" in proc.stdout


def test_slurm_unknown_argument(tmp_path: Path) -> None:
    proc = _slurm(tmp_path, "--bogus", expect=2)
    assert "unknown argument '--bogus'" in proc.stderr and not calls(tmp_path, "srun")


def _fake_venv(tmp: Path) -> Path:
    """A venv launch/_setup.sh accepts as installed: python = this interpreter, torchrun = the stub."""
    return fake_venv(tmp, _python_on_path)


def _single(tmp: Path, *args: str, expect: int) -> subprocess.CompletedProcess:
    env = stub_env(tmp, MEGALOOP_VENV=str(_fake_venv(tmp)), CONFIG="L", NPROC="8", PLAN_CLUSTER="h100",
                   RUN_DIR=str(tmp / "run"))
    proc = subprocess.run(["bash", str(ROOT / "launch" / "train_single_node.sh"), *args], env=env, cwd=tmp,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == expect, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def test_single_node_refusal_and_no_preflight(tmp_path: Path) -> None:
    big = TOO_BIG.split()
    proc = _single(tmp_path / "a", *big, expect=2)
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("megaloop preflight: refusing") and "TP1 PP1 DP8 mbs64" in line
    assert not calls(tmp_path / "a", "torchrun")
    _single(tmp_path / "b", big[0], "--no-preflight", big[1], expect=0)
    (rec,) = calls(tmp_path / "b", "torchrun")
    assert "--no-preflight" not in rec["argv"] and rec["argv"][-2:] == big
    proc = _single(tmp_path / "c", "train.max_steps=1000", expect=0)
    assert "megaloop preflight: ok: L at TP1 PP1 DP8 mbs2" in proc.stdout
    proc = _single(tmp_path / "d", "train.max_stpes=1000", expect=2)  # a configuration megaloop refuses
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("megaloop preflight: refusing: megaloop plan: error: train.max_stpes: unknown field")
    assert not calls(tmp_path / "d", "torchrun")
