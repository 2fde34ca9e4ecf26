"""Arm state, skip / resume decisions (megaloop/repro/runs.py) and the slurm launcher
(megaloop/sweep.py, slurm/sweep_array.sh) with fake run directories and stub sbatch / squeue / srun
/ torchrun (tests/slurm/stubs.py); no training here."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

from megaloop.repro import cli
from megaloop.repro.evaluate import SUMMARY
from megaloop.repro.runs import arm_state, check_identity, plan_sweep, run_dir
from megaloop.repro.spec import SpecError, load_plan
from tests.conftest import ROOT
from tests.repro.conftest import fake_checkpoint, fake_metrics
from tests.screen.slurm_stubs import sweep_stubs
from tests.slurm.stubs import calls, stub_env


def _finish_eval(rd: Path, plan, step: int, complete: bool = True) -> None:
    (rd / "eval").mkdir(parents=True, exist_ok=True)
    (rd / "eval" / SUMMARY).write_text(json.dumps({"step": step, "eval_digest": plan.eval.digest(),
                                                   "complete": complete, "stages": {}, "metrics": {}}))


def _done_arm(out: Path, plan, name: str, steps: int = 2) -> Path:
    """Arm ``name`` trained to ``steps`` (metrics, checkpoint) and evaluated with ``plan``."""
    rd = run_dir(out, name)
    fake_metrics(rd, steps)
    fake_checkpoint(rd, steps)
    _finish_eval(rd, plan, steps)
    return rd


def test_arm_states(user_yaml: Path, tmp_path: Path) -> None:
    plan = load_plan(str(user_yaml), "test")
    out = tmp_path / "out"
    arm = plan.arm("full")
    rd = run_dir(out, arm)
    assert arm_state(out, plan, arm)["status"] == "pending"
    fake_metrics(rd, 1)
    assert arm_state(out, plan, arm)["status"] == "partial"  # started, no checkpoint yet
    fake_checkpoint(rd, 1)
    assert arm_state(out, plan, arm) == {"status": "partial", "step": 1, "exit_code": None}
    (rd / "repro_exit").write_text("75\n")
    assert arm_state(out, plan, arm)["status"] == "interrupted"
    (rd / "repro_exit").write_text("1\n")
    assert arm_state(out, plan, arm)["status"] == "failed"
    fake_checkpoint(rd, 2)  # train.max_steps=2 reached
    assert arm_state(out, plan, arm)["status"] == "trained"  # not evaluated yet
    _finish_eval(rd, plan, 2, complete=False)
    assert arm_state(out, plan, arm)["status"] == "trained"  # a failed evaluation is redone
    _finish_eval(rd, plan, 1)
    assert arm_state(out, plan, arm)["status"] == "trained"  # evaluated an older checkpoint
    _finish_eval(rd, plan, 2)
    assert arm_state(out, plan, arm)["status"] == "done"
    other = load_plan(str(user_yaml), "test", eval_update={"max_seqs": 1})
    assert arm_state(out, other, other.arm("full"))["status"] == "trained"  # another eval plan


def _mark_started(out: Path, plan, name: str) -> None:
    sweep, _ = plan_sweep(out, plan)
    sweep.record_launch(sweep.runs[[r.name for r in sweep.runs].index(name)], "local", [])


def test_tools_wrapper_is_the_cli() -> None:
    spec = importlib.util.spec_from_file_location("reproduce_wrapper", ROOT / "tools" / "reproduce.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main is cli.main


def test_identity_guards_resume(user_yaml: Path, tmp_path: Path) -> None:
    plan = load_plan(str(user_yaml), "test")
    out = tmp_path / "out"
    _mark_started(out, plan, "b1")
    check_identity(out, plan, plan.arm("b1"))
    # run-control keys (stop_after, logging) may change between runs of an arm
    check_identity(out, load_plan(str(user_yaml), "test", ["train.stop_after=1", "logging.wandb=offline"]),
                   plan.arm("b1"))
    changed = load_plan(str(user_yaml), "test", ["model.hidden_size=64"])
    with pytest.raises(SpecError, match=r"arm 'b1' .* other settings .*model.hidden_size=64"):
        check_identity(out, changed, changed.arm("b1"))
    # the same settings, but the arm trained another model (a default changed since, e.g. QK-norm)
    import yaml

    from megaloop.config import load_config

    trained = load_config(plan.config, plan.arm("b1").overrides)
    (run_dir(out, plan.arm("b1")) / "config.yaml").write_text(yaml.safe_dump(trained.to_dict()))
    check_identity(out, plan, plan.arm("b1"))
    saved = trained.to_dict()
    saved["model"]["qk_norm"] = not saved["model"]["qk_norm"]
    (run_dir(out, plan.arm("b1")) / "config.yaml").write_text(yaml.safe_dump(saved))
    with pytest.raises(SpecError, match=r"arm 'b1' .* trained another model .*model.qk_norm: trained"):
        check_identity(out, plan, plan.arm("b1"))


def test_identity_compares_overrides_in_any_order(user_yaml: Path, tmp_path: Path) -> None:
    """The same overrides in another order are the same settings (they were refused, "differs in:
    config tiny"); a real difference is named as what it is now and was."""
    out = tmp_path / "out"
    plan = load_plan(str(user_yaml), "test", ["model.hidden_size=64", "optim.weight_decay=0.05"])
    _mark_started(out, plan, "b1")
    swapped = load_plan(str(user_yaml), "test", ["optim.weight_decay=0.05", "model.hidden_size=64"])
    assert swapped.arm("b1").overrides != plan.arm("b1").overrides  # another order ...
    check_identity(out, swapped, swapped.arm("b1"))  # ... the same settings
    # a key given twice acts by its last value
    twice = load_plan(str(user_yaml), "test", ["model.hidden_size=32", "optim.weight_decay=0.05", "model.hidden_size=64"])
    assert "model.hidden_size=32" in twice.arm("b1").overrides
    check_identity(out, twice, twice.arm("b1"))
    changed = load_plan(str(user_yaml), "test", ["optim.weight_decay=0.1", "model.hidden_size=64"])
    with pytest.raises(SpecError) as err:
        check_identity(out, changed, changed.arm("b1"))
    msg = str(err.value)
    assert "differs in: optim.weight_decay=0.1 (was optim.weight_decay=0.05)" in msg
    assert "config " not in msg.split("differs in:")[1]
    dropped = load_plan(str(user_yaml), "test", ["model.hidden_size=64"])
    with pytest.raises(SpecError, match=r"differs in: optim.weight_decay unset \(was optim.weight_decay=0.05\)"):
        check_identity(out, dropped, dropped.arm("b1"))


def test_cli_skips_done_and_resumes_partial(tool, user_yaml: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    plan = load_plan(str(user_yaml), "test")
    _done_arm(out, plan, "full")
    fake_checkpoint(run_dir(out, "b1"), 1)
    assert tool.main(["--experiment", str(user_yaml), "--scale", "test", "--out", str(out), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "skip full: done" in text and "b1: partial at step 1: resume" in text
    (cmd,) = [line for line in text.splitlines() if "would run" in line]
    assert f"--run-dir {run_dir(out, 'b1')} --resume auto" in cmd and "model.bptt_window=1" in cmd
    # a different experiment in the same directory is refused
    (out / "plan.json").write_text(json.dumps({"experiment": "other", "scale": "test"}))
    assert tool.main(["--experiment", str(user_yaml), "--scale", "test", "--out", str(out), "--dry-run"]) == 2
    assert "holds experiment 'other'" in capsys.readouterr().err


def test_out_that_is_a_file_exits_2(tool, user_yaml: Path, tmp_path: Path, capsys) -> None:
    f = tmp_path / "afile"
    f.write_text("kept")
    for argv in (["--experiment", str(user_yaml), "--scale", "test", "--dry-run"],
                 ["--render", str(ROOT / "tools" / "reproduce_results" / "tbptt_tiny" / "results.json")]):
        assert tool.main([*argv, "--out", str(f)]) == 2
        captured = capsys.readouterr()
        assert f"megaloop reproduce: error: --out: {f} exists and is not a directory" in captured.err
        assert "would run" not in captured.out and f.read_text() == "kept"


def test_a_default_out_under_a_file_exits_2(tool, user_yaml: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").write_text("kept")  # the default runs/repro_<experiment>_<scale> lies under a file
    assert tool.main(["--experiment", str(user_yaml), "--scale", "test", "--dry-run"]) == 2
    captured = capsys.readouterr()
    assert f"{tmp_path / 'runs'} is not a directory" in captured.err and "would run" not in captured.out
    assert (tmp_path / "runs").read_text() == "kept"


@pytest.fixture
def stubs(tmp_path: Path, monkeypatch):
    return sweep_stubs(tmp_path, monkeypatch, job_id="555")


def _slurm(tool, yaml: Path, out: Path, *extra: str) -> int:
    return tool.main(["--experiment", str(yaml), "--scale", "test", "--out", str(out), "--launcher", "slurm",
                      *extra, "--", "parallel.tp=1"])


def test_slurm_array_submission(tool, user_yaml: Path, stubs: Path, capsys) -> None:
    out = stubs / "out"
    assert _slurm(tool, user_yaml, out, "--parallel", "1", "--sbatch-arg=--partition=gpu") == 0
    (sb,) = calls(stubs, "sbatch")
    argv = sb["argv"]
    assert "--array=0-1%1" in argv and "--parsable" in argv and "--partition=gpu" in argv
    assert argv[-1] == str(ROOT / "slurm" / "sweep_array.sh") and f"--output={out}/slurm/%A_%a.out" in argv
    assert sb["env"]["MEGALOOP_ROOT"] == str(ROOT) and sb["env"]["SWEEP_EXIT_FILE"] == "repro_exit"
    args_dir = out / "slurm" / "sub000"
    assert sb["env"]["SWEEP_DIR"] == str(out) and sb["env"]["SWEEP_TASKS"] == str(args_dir)
    for i, name in enumerate(["full", "b1"]):
        lines = (args_dir / f"task_{i}.args").read_text().splitlines()
        assert lines[:2] == ["tiny", str(out / "arms" / name)]
        assert lines[-4] == "parallel.tp=1" and "train.eval_depth=2" in lines  # extras, then the tool's
        assert "--resume" not in lines  # slurm/common.sh always adds --resume auto
        # after training, the task evaluates the arm: `megaloop reproduce --evaluate-arm`
        after = (args_dir / f"task_{i}.after").read_text().splitlines()
        assert after == ["reproduce", "--evaluate-arm", name, "--out", str(out)]
    assert json.loads((out / "slurm" / "jobs.jsonl").read_text())["runs"] == {"0": "full", "1": "b1"}
    plan = json.loads((out / "plan.json").read_text())
    assert [a["name"] for a in plan["arms"]] == ["full", "b1"] and plan["eval"]["depth"] == 2
    capsys.readouterr()

    # while the array is queued, a rerun submits nothing and reports the arms as queued
    (stubs / "squeue.out").write_text("555_0\n555_1\n")
    assert _slurm(tool, user_yaml, out) == 0
    assert len(calls(stubs, "sbatch")) == 1
    assert capsys.readouterr().out.count("still queued/running in slurm job 555") == 2
    assert [a["status"] for a in json.loads((out / "results.json").read_text())["arms"]] == ["queued", "queued"]

    # arm `full` finished (trained + evaluated), b1 died: only b1 is resubmitted, in its own folder
    (stubs / "squeue.out").write_text("")
    loaded = load_plan(str(user_yaml), "test", ["parallel.tp=1"])
    fake_metrics(run_dir(out, "full"), 2)
    fake_checkpoint(run_dir(out, "full"), 2)
    _finish_eval(run_dir(out, "full"), loaded, 2)
    assert _slurm(tool, user_yaml, out, "--wait", "--poll", "0.01") == 1  # b1 never trains under stubs
    sb2 = calls(stubs, "sbatch")[-1]
    assert "--array=1" in sb2["argv"]
    assert sorted(p.name for p in (out / "slurm" / "sub001").iterdir()) == ["task_1.after", "task_1.args"]
    res = json.loads((out / "results.json").read_text())
    assert [a["status"] for a in res["arms"]] == ["done", "pending"] and res["complete"] is False


def test_slurm_dry_run(tool, user_yaml: Path, stubs: Path, capsys) -> None:
    assert _slurm(tool, user_yaml, stubs / "dry", "--dry-run") == 0
    text = capsys.readouterr().out
    assert "sbatch --parsable --array=0-1" in text and "task 1 b1: megaloop train --config tiny" in text
    assert not calls(stubs, "sbatch") and not (stubs / "dry").exists()


def _array_env(tmp: Path, out: Path, **extra: str) -> dict:
    eval_stub = tmp / "evalpy"
    eval_stub.write_text("#!/bin/sh\necho \"$@\" >> \"$STUB_DIR/eval_calls\"\n")
    eval_stub.chmod(0o755)
    env = stub_env(tmp, STUB_HOSTS="gpu-a01", SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="gpu-a01", SLURM_NNODES="1",
                   SLURM_NODEID="0", SLURM_SUBMIT_DIR=str(ROOT), VENV="none", LOG_DIR=str(tmp / "logs"),
                   GPUS_PER_NODE="2", SWEEP_DIR=str(out), SWEEP_EXIT_FILE="repro_exit", SLURM_ARRAY_TASK_ID="1",
                   PYTHON=str(eval_stub))
    env.update(extra)
    return env


def test_sweep_array_script_trains_then_evaluates(tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / "slurm").mkdir(parents=True)
    rd = out / "arms" / "b1"
    (out / "slurm" / "task_1.args").write_text(f"tiny\n{rd}\nmodel.bptt_window=1\ntrain.eval_depth=2\n")
    (out / "slurm" / "task_1.after").write_text(f"reproduce\n--evaluate-arm\nb1\n--out\n{out}\n")
    script = ["bash", str(ROOT / "slurm" / "sweep_array.sh")]
    env = _array_env(tmp_path, out)
    proc = subprocess.run(script, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (tr,) = calls(tmp_path, "torchrun")
    argv = tr["argv"]
    assert argv[argv.index("--config") + 1] == "tiny" and argv[argv.index("--run-dir") + 1] == str(rd)
    assert argv[argv.index("--resume") + 1] == "auto" and argv[-2:] == ["model.bptt_window=1", "train.eval_depth=2"]
    assert (rd / "repro_exit").read_text().strip() == "0"
    assert (tmp_path / "eval_calls").read_text().split() == [
        "-m", "megaloop.cli", "reproduce", "--evaluate-arm", "b1", "--out", str(out)]
    # training failed: exit status recorded, no evaluation
    (tmp_path / "eval_calls").unlink()
    proc = subprocess.run(script, env=dict(env, STUB_TORCHRUN="exit:3"), cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 3 and (rd / "repro_exit").read_text().strip() == "3"
    assert not (tmp_path / "eval_calls").exists()
    # clear errors outside an array job / for an index without an arm file
    env2 = dict(env)
    del env2["SLURM_ARRAY_TASK_ID"]
    proc = subprocess.run(script, env=env2, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "array job" in proc.stderr
    proc = subprocess.run(script, env=dict(env, SLURM_ARRAY_TASK_ID="7"), cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "task_7.args" in proc.stderr


@pytest.mark.parametrize("argv, words", [
    (["--depths", "0,5"], "--depths: expected comma-separated integers >= 1, got '0,5'"),
    (["--depths", ","], "--depths: expected comma-separated integers (no empty entries), got ','"),
    (["--depths", "5,,64"], "--depths: expected comma-separated integers (no empty entries), got '5,,64'"),
    (["--seeds", "1,,2"], "--seeds: expected comma-separated integers (no empty entries), got '1,,2'"),
    (["--depths", "a"], "--depths: expected comma-separated integers, got 'a'"),
    (["--arms", ","], "--arms: expected comma-separated arm names (no empty entries), got ','"),
    (["--arms", "full,,b1"], "--arms: expected comma-separated arm names (no empty entries)"),
    (["--arms", "full,full"], "--arms: 'full' is given twice"),
    (["--poll", "0", "--launcher", "slurm", "--wait"], "--poll: seconds between squeue polls, must be > 0"),
])
def test_bad_flags_are_named(tool, user_yaml: Path, tmp_path: Path, capsys, argv, words) -> None:
    out = tmp_path / "o"
    assert tool.main(["--experiment", str(user_yaml), "--scale", "test", "--out", str(out), "--dry-run", *argv]) == 2
    captured = capsys.readouterr()
    assert words in captured.err and "would run" not in captured.out, captured.err
    assert not out.exists()


def test_seedless_and_seeded_runs_do_not_share_an_out(tool, user_yaml: Path, tmp_path: Path, capsys) -> None:
    """--seeds 1234 into an OUT holding a seedless run retrained arms/full as arms/full.seed1234 and
    each report dropped the other mode's runs; refused both ways before anything runs."""
    from megaloop.repro.runs import write_plan

    out = tmp_path / "out"
    plan = load_plan(str(user_yaml), "test")
    _done_arm(out, plan, "full")
    write_plan(out, plan)
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    base = ["--experiment", str(user_yaml), "--scale", "test", "--out", str(out)]
    assert tool.main([*base, "--seeds", "1234"]) == 2
    err = capsys.readouterr().err
    assert "holds one run per arm without --seeds; runs with --seeds cannot join them" in err and "--merge" in err, err
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before
    seeded = tmp_path / "seeded"
    seeded.mkdir()
    write_plan(seeded, load_plan(str(user_yaml), "test", seeds=[1, 2]))
    assert tool.main(["--experiment", str(user_yaml), "--scale", "test", "--out", str(seeded), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "holds runs at --seeds [1, 2]; runs without --seeds cannot join them" in err, err
    assert "give --seeds 1,2 to continue them" in err, err
    assert tool.main(["--experiment", str(user_yaml), "--scale", "test", "--out", str(seeded), "--seeds", "3",
                      "--dry-run"]) == 0  # more seeds into a seeded OUT stay allowed


def test_out_inside_a_dataset_is_refused(tool, user_yaml: Path, tmp_path: Path, capsys) -> None:
    """--out inside data.path wrote plan.json, arms/ and the report into the training set."""
    data = tmp_path / "train"
    data.mkdir()
    (data / "index.json").write_text('{"shards": [], "version": 2}')
    for out in (data, data / "repro"):
        assert tool.main(["--experiment", str(user_yaml), "--scale", "test", "--out", str(out), "--",
                          f"data.path={data}"]) == 2
        err = capsys.readouterr().err
        assert f"--out {out} is" in err and f"the dataset data.path={data}" in err and "nothing was written" in err, err
    assert [p.name for p in data.iterdir()] == ["index.json"]


def test_out_inside_a_read_only_dataset_is_named_as_inside_it(tool, user_yaml: Path, tmp_path: Path, capsys,
                                                              monkeypatch) -> None:
    """The write probe ran first: inside a read-only dataset read "no file can be created" (root ignores
    file modes, so the probe is made to fail)."""
    import megaloop.runtime.files as files

    monkeypatch.setattr(files, "cannot_create_in", lambda p: "Read-only file system")
    data = tmp_path / "train"
    data.mkdir()
    (data / "index.json").write_text('{"shards": [], "version": 2}')
    assert tool.main(["--experiment", str(user_yaml), "--scale", "test", "--out", str(data / "repro"), "--",
                      f"data.path={data}"]) == 2
    err = capsys.readouterr().err
    assert f"the dataset data.path={data}" in err and "no file can be created" not in err, err
    assert tool.main(["--experiment", str(user_yaml), "--scale", "test", "--out", str(tmp_path / "o"), "--",
                      f"data.path={data}"]) == 2
    assert "no file can be created in" in capsys.readouterr().err


def test_a_subset_run_reports_every_arm_the_out_holds(tool, user_yaml: Path, tmp_path: Path, capsys) -> None:
    """--arms b1 on an OUT where both arms ran: results.json / report.md keep 'full' too."""
    out = tmp_path / "out"
    plan = load_plan(str(user_yaml), "test")
    for name in ("full", "b1"):
        _done_arm(out, plan, name)
        _mark_started(out, plan, name)
    from megaloop.repro.runs import write_plan

    write_plan(out, plan)
    assert tool.main(["--experiment", str(user_yaml), "--scale", "test", "--out", str(out), "--arms", "b1",
                      "--collect"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert [a["name"] for a in res["arms"]] == ["full", "b1"], res["arms"]
    capsys.readouterr()


def test_a_run_of_more_seeds_reports_every_seed_the_out_holds(tool, user_yaml: Path, tmp_path: Path, capsys) -> None:
    """--seeds 2 into a --seeds 0,1 folder rewrote results.json and report.md with seed 2 alone (plan.json
    kept all six runs); the report now covers every seed the folder holds, as --arms does for arms."""
    out = tmp_path / "out"
    plan = load_plan(str(user_yaml), "test", seeds=[0, 1, 2])
    from megaloop.repro.runs import write_plan

    for arm in plan.arms:
        _done_arm(out, plan, arm.name)
        _mark_started(out, plan, arm.name)
    write_plan(out, load_plan(str(user_yaml), "test", seeds=[0, 1]))
    assert tool.main(["--experiment", str(user_yaml), "--scale", "test", "--out", str(out), "--seeds", "2",
                      "--collect"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert sorted(a["name"] for a in res["arms"]) == sorted(a.name for a in plan.arms), res["arms"]
    assert res["seeds"] == [0, 1, 2]
    capsys.readouterr()


def test_out_holding_an_lr_screen_is_refused(tool, user_yaml: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "screen"
    out.mkdir()
    (out / "screen.json").write_text("{}")
    (out / "results.json").write_text(json.dumps({"grid": [1e-3], "points": []}))
    before = (out / "results.json").read_bytes()
    assert tool.main(["--experiment", str(user_yaml), "--scale", "test", "--out", str(out), "--collect"]) == 2
    assert f"--out: {out} holds a `megaloop lr-screen` result" in capsys.readouterr().err
    assert (out / "results.json").read_bytes() == before and sorted(p.name for p in out.iterdir()) == \
        ["results.json", "screen.json"]


def test_collect_with_another_eval_plan_is_refused(tool, user_yaml: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    plan = load_plan(str(user_yaml), "test")
    _done_arm(out, plan, "full")
    argv = ["--experiment", str(user_yaml), "--scale", "test", "--out", str(out), "--arms", "full", "--collect"]
    assert tool.main([*argv, "--depths", "1,2"]) == 2
    err = capsys.readouterr().err
    assert "--collect: arm 'full' was evaluated with another plan" in err, err
    assert not (out / "results.json").exists()
    assert tool.main(argv) == 0  # the same plan collects
    capsys.readouterr()
    # a folder holding no experiment (a typo) was created and filled with an all-pending report, then
    # claimed for this experiment
    typo = tmp_path / "typo"
    assert tool.main([*argv[:4], "--out", str(typo), "--collect"]) == 2
    assert f"--collect: {typo} holds no experiment (no plan.json, no arms/); nothing to collect" in \
        capsys.readouterr().err
    assert not typo.exists()
