"""Per-arm LR screens and seeds of an experiment file (megaloop/repro/screens.py, spec.py, runs.py):
validation before anything runs, the screen runs first, the arms wait for their screen, then train at
the selected rate; a rerun resumes (finished points are skipped); seeds expand every arm into runs
with their own ``train.seed``. Fake run directories; no training here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megaloop.repro.runs import check_identity, resolve_lrs, screen_dir, screen_result
from megaloop.repro.spec import SpecError, load_plan
from tests.repro.conftest import USER_YAML, fake_checkpoint
from tests.repro.test_runner import _mark_started

EVAL_LINE = "    eval: {max_seqs: 2, depths: [1, 2, 4], harness_limit: 2, batch_size: 2}\n"
SCREENED = (USER_YAML.replace(EVAL_LINE, EVAL_LINE + "    screen: {grid: [1e-3, 2e-3, 4e-3], stop_after: 1}\n")
            .replace('  b1: {label: "b=1", overrides: [model.bptt_window=1]}',
                     '  b1: {label: "b=1", overrides: [model.bptt_window=1], lr: {same_as: full}}')
            + "lr: screen\n")


def _yaml(tmp_path: Path, text: str, name: str = "mine.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def _finish_point(out: Path, arm: str, lr: str, val_ce: float, step: int = 1) -> None:
    rd = screen_dir(out, arm) / f"lr_{lr}"
    rd.mkdir(parents=True, exist_ok=True)
    (rd / "metrics.jsonl").write_text(json.dumps({"step": step, "loss": 5.0, "val_ce": val_ce}) + "\n")


def _dry(tool, path: Path, out: Path, capsys) -> str:
    assert tool.main(["--experiment", str(path), "--scale", "test", "--out", str(out), "--dry-run"]) == 0
    return capsys.readouterr().out


def test_screen_plan_validates(tmp_path: Path) -> None:
    plan = load_plan(str(_yaml(tmp_path, SCREENED)), "test")
    assert plan.screen.grid == [1e-3, 2e-3, 4e-3] and plan.screen.stop_after == 1
    assert plan.screen.screen_set == "default:screen" and plan.screen.eval_depth == 5
    assert [(a.name, a.lr) for a in plan.arms] == [("full", "screen"), ("b1", "same_as:full")]
    assert not any(o.startswith("optim.lr=") for a in plan.arms for o in a.overrides)
    # defaults of the scale's preset (the LR-screen tool's tiny range and points)
    plain = load_plan(str(_yaml(tmp_path, SCREENED.replace("grid: [1e-3, 2e-3, 4e-3], ", ""), "d.yaml")), "test")
    assert plain.screen.grid == [0.001, 0.002, 0.004, 0.008]
    # a fixed number is an override; --arms b1 keeps the arm whose rate it reuses
    fixed = load_plan(str(_yaml(tmp_path, USER_YAML + "lr: 0.002\n", "f.yaml")), "test")
    assert all(a.overrides[-4] == "optim.lr=0.002" and a.lr is None for a in fixed.arms) and fixed.screen is None
    assert [a.name for a in load_plan(str(_yaml(tmp_path, SCREENED)), "test", only=["b1"]).arms] == ["full", "b1"]


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace("lr: screen\n", "lr: scren\n"), r"arm 'full': lr: expected a positive number, `screen`"),
    (lambda t: t.replace("{same_as: full}", "{same_as: nope}"), r"arm 'b1': lr: same_as 'nope' is not an arm"),
    (lambda t: t.replace("lr: screen\n", "").replace("{same_as: full}", "{same_as: full}, overrides: []")
     .replace('  b1: {label: "b=1", overrides: [model.bptt_window=1], lr: {same_as: full}, overrides: []}',
              '  b1: {label: "b=1", lr: {same_as: full}}'),
     r"arm 'b1': lr: same_as 'full' does not screen its LR"),
    (lambda t: t.replace('full: "model.bptt_window=2"', 'full: "model.bptt_window=2 optim.lr=0.01"'),
     r"arm 'full': optim.lr is set by `lr:`"),
    (lambda t: t.replace("stop_after: 1}", "stop_after: 5}"),
     r"scales.test.screen.stop_after: 5 exceeds the horizon train.max_steps=2"),
    (lambda t: t.replace("grid: [1e-3, 2e-3, 4e-3]", "grid: [1e-3, 2e-3]"), r"scales.test.screen: the grid .* fewer than 3"),
    (lambda t: t.replace("stop_after: 1}", "stop_after: 1, points: 3}"), r"scales.test.screen.grid: give either grid"),
    (lambda t: t.replace("stop_after: 1}", "stop_after: 1, every: 3}"), r"scales.test.screen: unknown key\(s\) every"),
    (lambda t: t.replace("grid: [1e-3, 2e-3, 4e-3]", "grid: [1e-3, 1.0000001e-3, 2e-3, 4e-3]"),
     r"scales.test.screen.grid: learning rates 0.001 coincide at 6 significant digits"),
    # a repeated rate was dropped silently (lr-screen --grid refuses it), and [1e-3, 0.001, 2e-3] was
    # reported as "fewer than 3 points"
    (lambda t: t.replace("grid: [1e-3, 2e-3, 4e-3]", "grid: [1e-3, 0.001, 2e-3, 4e-3]"),
     r"scales.test.screen.grid: learning rate 0.001 is given twice; drop one"),
    (lambda t: t.replace("stop_after: 1}", "stop_after: 1, screen_set: /nonexistent/screen}"),
     r"scales.test.screen.screen_set: /nonexistent/screen is not a directory"),
    (lambda t: t + "seeds: [1, 1]\n", r"seeds: \[1, 1\] repeats a seed"),
    (lambda t: t + "seeds: 3\n", r"seeds: expected a non-empty list"),
])
def test_bad_screen_or_seed_settings_exit_2_naming_the_field(tool, capsys, tmp_path: Path, edit, message) -> None:
    path = _yaml(tmp_path, edit(SCREENED), "bad.yaml")
    code = tool.main(["--experiment", str(path), "--scale", "test", "--out", str(tmp_path / "out"), "--dry-run"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert str(path) in err
    import re
    assert re.search(message, err), err
    assert not (tmp_path / "out").exists()


def test_screen_first_then_arms_at_the_selected_rate_and_resume(tool, capsys, tmp_path: Path) -> None:
    path, out = _yaml(tmp_path, SCREENED), tmp_path / "out"
    text = _dry(tool, path, out, capsys)
    cmds = [line for line in text.splitlines() if "would run" in line]
    assert len(cmds) == 3  # only the screen of `full` (b1 reuses its rate); the arms wait
    assert all("train.stop_after=1 data.val_path=default:screen train.eval_depth=5" in c for c in cmds)
    assert "optim.lr=0.001" in cmds[0] and f"--run-dir {screen_dir(out, 'full').resolve()}/lr_0.001" in cmds[0]
    assert "model.bptt_window=2" in cmds[0]  # the arm's own config is screened
    assert "full: waiting for its LR screen" in text and "b1: waiting for its LR screen" in text

    # two points finished, one still running: the arms keep waiting; the finished points are skipped
    _finish_point(out, "full", "0.001", 5.0)
    _finish_point(out, "full", "0.002", 4.0)
    text = _dry(tool, path, out, capsys)
    assert "skip full/lr_0.001: done" in text and "skip full/lr_0.002: done" in text
    assert len([line for line in text.splitlines() if "would run" in line]) == 1 and "waiting" in text

    # the screen completes: both arms train at the interior optimum 2e-3
    _finish_point(out, "full", "0.004", 4.5)
    plan, screens, waiting = resolve_lrs(out, load_plan(str(path), "test"))
    assert waiting == [] and screens["full"]["best_lr"] == 0.002 and screens["full"]["interior"]
    assert all(a.overrides[-1] == "optim.lr=0.002" for a in plan.arms)
    text = _dry(tool, path, out, capsys)
    cmds = [line for line in text.splitlines() if "would run" in line]
    assert len(cmds) == 2 and all("optim.lr=0.002; then" in c for c in cmds) and "waiting" not in text

    # an arm started at the selected rate may not be resumed once the screen selects another
    _mark_started(out, plan, "b1")
    fake_checkpoint(out / "arms" / "b1", 1)
    check_identity(out, plan, plan.arm("b1"))
    _finish_point(out, "full", "0.004", 3.0)
    moved, _, _ = resolve_lrs(out, load_plan(str(path), "test"))
    with pytest.raises(SpecError, match=r"arm 'b1' .* other settings .*optim.lr="):
        check_identity(out, moved, moved.arm("b1"))


def test_edge_optimum_and_diverged_points(tmp_path: Path) -> None:
    path, out = _yaml(tmp_path, SCREENED), tmp_path / "out"
    plan = load_plan(str(path), "test")
    _finish_point(out, "full", "0.001", 5.0)
    _finish_point(out, "full", "0.002", 4.8)
    _finish_point(out, "full", "0.004", float("nan"))  # diverged: counts as worse than any finite CE
    res = screen_result(out, plan, "full")
    assert res["complete"] and res["best_lr"] == 0.002 and res["interior"]
    _finish_point(out, "full", "0.004", 4.0)
    res = screen_result(out, plan, "full")
    assert res["best_lr"] == 0.004 and res["edge"] == "upper" and res["proposed_grid"][-1] == 0.008


def test_seeds_expand_every_arm(tmp_path: Path) -> None:
    plan = load_plan(str(_yaml(tmp_path, USER_YAML + "seeds: [3, 4]\n")), "test")
    assert [a.name for a in plan.arms] == ["full.seed3", "full.seed4", "b1.seed3", "b1.seed4"]
    assert [(a.arm, a.seed) for a in plan.arms][:2] == [("full", 3), ("full", 4)]
    assert plan.arms[1].overrides[-1] == "train.seed=4" and plan.settings["seeds"] == [3, 4]
    assert plan.groups() == ["full", "b1"] and [a.name for a in plan.runs_of("b1")] == ["b1.seed3", "b1.seed4"]
    only = load_plan(str(_yaml(tmp_path, USER_YAML + "seeds: [3, 4]\n")), "test", only=["b1.seed4"])
    assert [a.name for a in only.arms] == ["b1.seed4"]
    with pytest.raises(SpecError, match="command-line override train.seed"):
        load_plan(str(_yaml(tmp_path, USER_YAML + "seeds: [3, 4]\n")), "test", ["train.seed=1"])
    clash = USER_YAML.replace("  b1: {", '  full.seed3: "model.bptt_window=1"\n  b1: {') + "seeds: [3]\n"
    with pytest.raises(SpecError, match="'full.seed3': the name of a seeded run"):
        load_plan(str(_yaml(tmp_path, clash, "clash.yaml")), "test")


def test_seeds_on_the_command_line(tool, capsys, tmp_path: Path) -> None:
    path, out = _yaml(tmp_path, USER_YAML), tmp_path / "out"
    assert tool.main(["--experiment", str(path), "--scale", "test", "--out", str(out), "--dry-run",
                      "--seeds", "5,6"]) == 0
    cmds = [line for line in capsys.readouterr().out.splitlines() if "would run" in line]
    assert len(cmds) == 4 and f"--run-dir {out.resolve()}/arms/b1.seed6 " in cmds[3]
    assert "train.seed=6; then" in cmds[3] and "--evaluate-arm b1.seed6" in cmds[3]
    for bad in ("a", "1,1", "-1"):
        assert tool.main(["--experiment", str(path), "--scale", "test", "--out", str(out), "--dry-run",
                          f"--seeds={bad}"]) == 2
        assert "--seeds: expected" in capsys.readouterr().err


def test_slurm_dry_run_submits_the_screen_and_lists_waiting_arms(tool, capsys, tmp_path: Path) -> None:
    path, out = _yaml(tmp_path, SCREENED), tmp_path / "out"
    assert tool.main(["--experiment", str(path), "--scale", "test", "--out", str(out), "--dry-run",
                      "--launcher", "slurm"]) == 0
    text = capsys.readouterr().out
    (sbatch,) = [line for line in text.splitlines() if "sbatch" in line]  # one array: the screen's 3 points
    assert "--array=0-2 " in sbatch
    assert "task 2 full/lr_0.004: megaloop train" in text and "full: waiting for its LR screen" in text
