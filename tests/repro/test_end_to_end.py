"""megaloop reproduce end to end on a user-written 2-arm experiment of 2 tiny steps: an interrupted
first pass (train.stop_after=1) leaves both arms partial; the rerun resumes them from their
checkpoints, evaluates and reports; a third run skips both arms."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megaloop.repro.runs import arm_state
from megaloop.repro.spec import load_plan


def _launches(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "launches.jsonl").read_text().splitlines()]


def test_user_experiment_interrupt_resume_skip(tool, user_yaml: Path, tmp_path: Path, capsys,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "disabled")
    out = tmp_path / "out"
    base = ["--experiment", str(user_yaml), "--scale", "test", "--out", str(out), "--threads", "2"]

    assert tool.main([*base, "--", "train.stop_after=1"]) == 1  # stopped early: unfinished
    res = json.loads((out / "results.json").read_text())
    assert [(a["name"], a["status"], a["step"]) for a in res["arms"]] == [("full", "partial", 1), ("b1", "partial", 1)]
    assert not (out / "arms" / "full" / "eval").exists()
    capsys.readouterr()

    assert tool.main(base) == 0
    text = capsys.readouterr().out
    assert "full: partial at step 1: resume" in text and "resuming from step 1" in text
    launches = _launches(out)
    assert len(launches) == 4 and all(x["resumed"] for x in launches[2:])
    res = json.loads((out / "results.json").read_text())
    assert res["complete"] and [a["status"] for a in res["arms"]] == ["done", "done"]
    for a in res["arms"]:
        m = a["metrics"]
        for k in ("native_ppl", "terminal_ppl", "per_visit_ppl", "sharing_penalty_pct", "extrapolation_pct",
                  "train_flops", "downstream"):
            assert isinstance(m[k], float), (a["name"], k)
        assert m["sharing_penalty_pct"] == pytest.approx(100 * (m["terminal_ppl"] / m["per_visit_ppl"] - 1))
        by_depth = {r["depth"]: r["native_ppl"] for r in m["sweep"]}
        assert sorted(by_depth) == [1, 2, 4] and m["native_ppl"] == by_depth[2]  # R = 2
        assert m["extrapolation_pct"] == pytest.approx(100 * (by_depth[4] / by_depth[2] - 1))
        assert a["train"]["steps"] == 2 and a["train"]["tokens"] == 2 * 16 * 128
        assert 0 <= m["downstream"] <= 1 and m["prior_mean"] == pytest.approx(2.0)
    # same seed and data order: the first step's loss (before any update; bptt_window only changes the
    # backward pass) is the same in both arms
    first = [json.loads((out / "arms" / n / "metrics.jsonl").read_text().splitlines()[0])["loss"]
             for n in ("full", "b1")]
    assert first[0] == pytest.approx(first[1], rel=1e-6)
    md = (out / "report.md").read_text()
    assert "| full | " in md and "| b=1 (`b1`) | " in md and "| C2 |" in md
    for name in ("ppl_vs_depth.png", "prior_evolution.png", "training_curves.png"):
        assert (out / name).stat().st_size > 10_000
    eval_files = sorted(p.name for p in (out / "arms" / "b1" / "eval").iterdir())
    assert {"harness.json", "summary.json", "sweep.json", "sweep.png"} <= set(eval_files)

    assert tool.main(base) == 0  # finished arms are skipped: nothing is launched
    text = capsys.readouterr().out
    assert "skip full: done" in text and "skip b1: done" in text
    assert len(_launches(out)) == 4
    # a changed evaluation plan makes the arms "trained" (re-evaluated, not retrained)
    plan = load_plan(str(user_yaml), "test", eval_update={"depths": [1, 2]})
    assert arm_state(out, plan, plan.arm("b1"))["status"] == "trained"
