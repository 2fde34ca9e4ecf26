"""One arm's evaluation plan (megaloop/repro/evaluate.py) with the synthetic task: the stage
commands, the metrics from ``megaloop eval synth``'s table, and the summary an evaluation writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megaloop.eval.synth import SHIPPED
from megaloop.repro.evaluate import evaluate_arm, stage_commands, synth_curve, synth_metrics
from megaloop.repro.spec import Arm, EvalPlan
from tests.repro.conftest import fake_checkpoint

# eval synth's JSON (only the fields read): accuracy per k (rows) and depth (columns)
TABLE = {"ks": [1, 2, 3, 4], "depths": [1, 2, 5, 64], "n": [10, 10, 20, 30],
         "acc": [[1.0, 1.0, 1.0, 1.0], [0.5, 1.0, 1.0, 1.0], [0.2, 0.4, 0.9, 0.85], [0.1, 0.3, 0.8, 0.6]]}


def test_synth_metrics_by_hand() -> None:
    m = synth_metrics(TABLE, depth=5, min_k=3)
    # k >= 3: 20 problems of k=3 and 30 of k=4, weighted by count
    assert m["synth_acc"] == pytest.approx((20 * 0.9 + 30 * 0.8) / 50)        # 0.84
    assert m["synth_acc_r1"] == pytest.approx((20 * 0.2 + 30 * 0.1) / 50)     # 0.14
    assert m["synth_extrap_pts"] == pytest.approx(100 * ((20 * 0.85 + 30 * 0.6) / 50 - 0.84))  # -14
    assert m["synth_table"]["acc"] == TABLE["acc"] and m["synth_table"]["n"] == TABLE["n"]
    # the per-depth curve the metrics and the report's plot both read
    assert synth_curve(TABLE, 3) == pytest.approx([(20 * a + 30 * b) / 50 for a, b in zip(TABLE["acc"][2], TABLE["acc"][3])])
    assert synth_curve(TABLE, 9) is None
    assert synth_metrics(TABLE, depth=2, min_k=1)["synth_acc"] == pytest.approx((10 + 10 + 20 * 0.4 + 30 * 0.3) / 70)
    none = synth_metrics(TABLE, depth=8, min_k=9)  # depth not scored, no k >= 9
    assert none["synth_acc"] is None and none["synth_acc_r1"] is None and none["synth_extrap_pts"] is None


def test_stage_commands_with_and_without_the_sweep(tmp_path: Path) -> None:
    arm = Arm(name="a", label="a", overrides=[])
    plan = EvalPlan(depth=5, depths=[1, 5, 64], sweep=False, harness=[], synth="probs.jsonl")
    cmds = stage_commands(tmp_path, arm, plan, threads=1, device="cpu", python="py")
    assert list(cmds) == ["synth"]
    argv = cmds["synth"]
    assert argv[:5] == ["py", "-m", "megaloop.cli", "eval", "synth"]
    assert argv[argv.index("--depths") + 1] == "1,5,64" and argv[argv.index("--problems") + 1] == "probs.jsonl"
    assert argv[argv.index("--json") + 1] == str(tmp_path / "eval" / "synth.json")
    shipped = stage_commands(tmp_path, arm, EvalPlan(synth="shipped"), threads=None, device="cpu", python="py")
    assert list(shipped) == ["synth", "sweep", "harness"]
    assert shipped["synth"][shipped["synth"].index("--problems") + 1] == str(SHIPPED)  # the file, not the default
    assert list(stage_commands(tmp_path, arm, EvalPlan(), threads=None, device="cpu")) == ["sweep", "harness"]


def test_evaluate_arm_summarises_the_synth_stage(tmp_path: Path) -> None:
    run_dir = tmp_path / "arm"
    fake_checkpoint(run_dir, 100)
    plan = EvalPlan(depth=5, depths=[1, 2, 5, 64], sweep=False, harness=[], synth="shipped")
    calls = []

    def run(argv, log, env):  # stands in for `megaloop eval synth`: writes its JSON
        calls.append(argv[4])
        Path(argv[argv.index("--json") + 1]).write_text(json.dumps(TABLE))
        return 0

    summary = evaluate_arm(run_dir, Arm(name="a", label="a", overrides=[]), plan, max_steps=100, run=run,
                           log=lambda _: None)
    assert calls == ["synth"] and summary["complete"] and summary["stages"] == {"synth": "ok"}
    assert summary["metrics"]["synth_acc"] == pytest.approx(0.84)
    assert summary["metrics"]["synth_extrap_pts"] == pytest.approx(-14.0)
    again = evaluate_arm(run_dir, Arm(name="a", label="a", overrides=[]), plan, max_steps=100, run=run,
                         log=lambda _: None)
    assert calls == ["synth"] and again["metrics"]["synth_acc"] == pytest.approx(0.84)  # not redone


def test_untied_arm_runs_its_eval_commands_without_depth_flags(tmp_path: Path) -> None:
    """An untied arm's stage commands, run for real on a small untied model: no --depth/--depths (which
    every eval command refuses on an untied model, so `reproduce --experiment untied` failed at its
    untied arms' evaluation), `eval ppl --cache both` in place of the sweep, and the summary reads it as
    the one row at R (native, terminal and per-visit PPL), the synth column as R."""
    import math
    import subprocess
    import sys

    import shutil

    from megaloop.data.default_tokenizer import DEFAULT_VOCAB_SIZE, ensure_default_tokenizer
    from megaloop.repro.evaluate import summarize
    from tests.conftest import ROOT, clean_env
    from tests.inference.helpers import make_model

    model = tmp_path / "untied"  # the embedded corpus's tokenizer: eval.data "default" checks it
    make_model(seed=3, vocab=DEFAULT_VOCAB_SIZE, real_vocab=DEFAULT_VOCAB_SIZE, max_position_embeddings=128,
               arch="untied", num_hidden_layers=2).save_pretrained(model)
    shutil.copytree(ensure_default_tokenizer().parent, model, dirs_exist_ok=True)
    plan = EvalPlan(depth=5, depths=[1, 5], max_seqs=4, batch_size=4, harness=["megaloop_toy_mc"], harness_limit=2,
                    synth="shipped")
    cmds = stage_commands(model, Arm(name="u", label="u", overrides=[], looped=False), plan, threads=1, device="cpu")
    assert list(cmds) == ["synth", "ppl", "harness"]
    for argv in cmds.values():
        assert "--depth" not in argv and "--depths" not in argv, argv
    (model / "eval").mkdir()
    env = {**clean_env(), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    for stage, argv in cmds.items():
        if stage == "synth":
            argv = [*argv, "--ks", "1-2", "--limit", "2"]
        proc = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, f"{stage}: exit {proc.returncode}\n{proc.stderr[-2000:]}"
    m = summarize(model, plan, looped=False)
    assert [r["depth"] for r in m["sweep"]] == [5] and m["extrapolation_pct"] is None
    for key in ("native_ppl", "terminal_ppl", "per_visit_ppl"):
        assert math.isfinite(m[key]) and m[key] > 1, (key, m[key])
    assert m["sharing_penalty_pct"] == pytest.approx(0.0, abs=1e-6)  # no recurrence: nothing to share
    assert m["eval_seqs"] == 4 and m["synth_acc"] is None and m["synth_table"]["depths"] == [5]
    assert m["downstream"] is not None


def test_a_stage_stops_when_its_evaluate_arm_process_is_killed(tmp_path):
    """`kill -9` of `reproduce --evaluate-arm` left its running stage (eval harness, sweep) evaluating on as
    an orphan; the stage now gets SIGTERM when that process dies."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import ROOT, clean_env

    pidfile, log = tmp_path / "stage.pid", tmp_path / "stage.log"
    stage = [sys.executable, "-c", f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); "
                                   "time.sleep(300)"]
    env = {**clean_env(), "PYTHONPATH": str(ROOT)}
    code = (f"from pathlib import Path; from megaloop.repro.evaluate import _run_plain; "
            f"_run_plain({stage!r}, Path({str(log)!r}), {env!r})")
    proc = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:
        deadline = time.time() + 60
        while not (pidfile.is_file() and pidfile.read_text()) and time.time() < deadline:
            time.sleep(0.1)
        child = int(pidfile.read_text())
        proc.kill()
        proc.wait(timeout=30)
        def gone() -> bool:
            try:
                return "\nState:\tZ" in Path(f"/proc/{child}/status").read_text()  # a zombie is dead
            except FileNotFoundError:
                return True

        deadline = time.time() + 30
        while not gone() and time.time() < deadline:
            time.sleep(0.1)
        if not gone():
            os.kill(child, signal.SIGKILL)
            raise AssertionError("the stage ran on after its evaluate-arm process was killed")
    finally:
        if proc.poll() is None:
            proc.kill()
