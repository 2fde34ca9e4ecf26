"""megaloop lr-screen (megaloop/screen): grid construction, input errors, run-state detection, edge
detection, and one real 3-point screen of the tiny config on CPU (then a rerun that launches nothing)."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megaloop.screen import cli
from megaloop.screen.core import SCALE_DEFAULTS, log_grid, lr_tag, parse_grid, point_state, scale_of, select_best
from megaloop.sweep import compress_indices
from tests.conftest import ROOT


def test_tools_wrapper_is_the_cli() -> None:
    spec = importlib.util.spec_from_file_location("lr_screen_wrapper", ROOT / "tools" / "lr_screen.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main is cli.main


# ----------------------------------------------------------------------------------------- grid
def test_log_grid() -> None:
    assert log_grid(0.5e-3, 4e-3, 7) == [0.0005, 0.000707, 0.001, 0.00141, 0.002, 0.00283, 0.004]
    g = log_grid(0.125e-3, 2e-3, 9)
    assert g[0] == 0.000125 and g[-1] == 0.002 and len(g) == 9
    ratios = [b / a for a, b in zip(g, g[1:])]
    assert all(abs(r - math.sqrt(2)) < 0.01 for r in ratios)
    assert parse_grid("4e-3, 1e-3,2e-3") == [1e-3, 2e-3, 4e-3]  # sorted
    assert lr_tag(1e-5) == "1e-05" and lr_tag(0.000707) == "0.000707"


def test_scale_defaults_follow_spec() -> None:
    d = SCALE_DEFAULTS
    assert d["S"]["range"] == (0.5e-3, 4e-3) and 512 <= d["S"]["stop_after"] <= 1024
    assert d["M"]["range"] == (0.25e-3, 4e-3) and 2048 <= d["M"]["stop_after"] <= 12288
    assert d["L"]["range"] == (0.125e-3, 2e-3) and 8192 <= d["L"]["stop_after"] <= 32768
    assert scale_of("untied12") == "S" and scale_of("megaloop/configs/L.yaml") == "L"
    assert scale_of("my.yaml") is None


@pytest.mark.parametrize("argv, arg, words", [
    (["--grid", ""], "--grid", "empty grid"),
    (["--grid", " , "], "--grid", "empty grid"),
    (["--grid", "1e-3,,2e-3"], "--grid", "empty entry"),
    (["--grid", "1e-3,0,2e-3"], "--grid", "must be > 0"),
    (["--grid", "1e-3,-2e-3,4e-3"], "--grid", "must be > 0"),
    (["--grid", "1e-3,abc,4e-3"], "--grid", "not a number"),
    (["--grid", "1e-3,nan,4e-3"], "--grid", "not a finite"),
    (["--grid", "1e-3,1e-3,4e-3"], "--grid", "duplicate"),
    (["--grid", "1e-3,2e-3"], "--grid", "at least 3"),
    (["--range", "2e-3,1e-3"], "--range", "must be < HI"),
    (["--range", "1e-3,1e-3"], "--range", "must be < HI"),
    (["--range", "0,1e-3"], "--range", "LO must be > 0"),
    (["--range", "1e-3"], "--range", "LO,HI"),
    (["--range", "1e-3,4e-3", "--points", "2"], "--points", "at least 3"),
    (["--grid", "1e-3,2e-3,4e-3", "--points", "5"], "--points", "only applies to --range"),
    (["--grid", "1e-3,2e-3,4e-3", "--stop-after", "0"], "--stop-after", ">= 1"),
    (["--grid", "1e-3,2e-3,4e-3", "--stop-after", "100000"], "--stop-after", "horizon"),
    (["--grid", "1e-3,2e-3,4e-3", "--eval-batches", "0"], "--eval-batches", ">= 1"),
    (["--grid", "1e-3,2e-3,4e-3", "--", "optim.lr=1"], "optim.lr", "--grid/--range"),
    (["--grid", "1e-3,2e-3,4e-3", "--", "data.val_path=/x"], "data.val_path", "--screen-set"),
    (["--grid", "1e-3,2e-3,4e-3", "--", "model.num_heads=0"], "--config", "model.num_heads"),
    (["--grid", "1e-3,2e-3,4e-3", "--", "data.path=/data/mds"], "--screen-set", "required"),
    (["--grid", "1e-3,2e-3,4e-3", "--screen-set", "/nonexistent/screen"], "--screen-set", "not a directory"),
])
def test_bad_inputs_exit_2(tmp_path: Path, capsys, argv, arg, words) -> None:
    code = cli.main(["--config", "tiny", "--out", str(tmp_path / "s"), "--dry-run", *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"error: {arg}" in err or f"'{arg}" in err, err
    assert words in err, err


def test_out_that_is_a_file_exits_2(tmp_path: Path, capsys) -> None:
    f = tmp_path / "afile"
    f.write_text("kept")
    assert cli.main(["--config", "tiny", "--out", str(f), "--dry-run"]) == 2
    captured = capsys.readouterr()
    assert f"megaloop lr-screen: error: --out: {f} exists and is not a directory" in captured.err
    assert "would run" not in captured.out and f.read_text() == "kept"


def test_config_errors_exit_2(tmp_path: Path, capsys) -> None:
    assert cli.main(["--config", "nosuch", "--grid", "1e-3,2e-3,4e-3", "--stop-after", "4",
                      "--out", str(tmp_path), "--dry-run"]) == 2
    assert "nosuch" in capsys.readouterr().err
    # without --grid/--stop-after the unknown preset is still what is named (not the missing defaults)
    assert cli.main(["--config", "nosuch", "--out", str(tmp_path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "error: --config nosuch: config 'nosuch': no such file or preset" in err, err
    # a preset without defaults needs an explicit grid / stop
    yaml = tmp_path / "custom.yaml"
    yaml.write_text((ROOT / "megaloop" / "configs" / "tiny.yaml").read_text())
    assert cli.main(["--config", str(yaml), "--out", str(tmp_path / "o"), "--dry-run"]) == 2
    assert "--grid/--range" in capsys.readouterr().err
    # optim.min_lr above a grid point is caught before anything runs
    assert cli.main(["--config", "tiny", "--grid", "1e-4,1e-3,1e-2", "--out", str(tmp_path / "o"),
                      "--dry-run", "--", "optim.min_lr=5e-4"]) == 2
    assert "optim.min_lr" in capsys.readouterr().err


def test_screen_set_seq_len_is_checked(tmp_path: Path, capsys) -> None:
    scr = tmp_path / "screen"
    scr.mkdir()
    (scr / "manifest.json").write_text(json.dumps({"kind": "screen", "seq_len": 1536, "num_sequences": 304}))
    assert cli.main(["--config", "tiny", "--grid", "1e-3,2e-3,4e-3", "--screen-set", str(scr),
                      "--out", str(tmp_path / "o"), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "--screen-set" in err and "1536" in err and "--screen-seq-len 128" in err
    (scr / "manifest.json").write_text(json.dumps({"kind": "screen", "seq_len": 128, "num_sequences": 20}))
    assert cli.main(["--config", "tiny", "--grid", "1e-3,2e-3,4e-3", "--screen-set", str(scr),
                      "--out", str(tmp_path / "o"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    # validation covers eval_batches x global_batch_size sequences: ceil(20 / gbs 16)
    assert f"data.val_path={scr}" in out and "train.eval_batches=2" in out
    # a shorter set is fine: the trainer evaluates at the set's own length
    (scr / "manifest.json").write_text(json.dumps({"kind": "screen", "seq_len": 64, "num_sequences": 20}))
    assert cli.main(["--config", "tiny", "--grid", "1e-3,2e-3,4e-3", "--screen-set", str(scr),
                      "--out", str(tmp_path / "o"), "--dry-run"]) == 0


def test_dry_run_defaults(tmp_path: Path, capsys) -> None:
    assert cli.main(["--config", "S", "--out", str(tmp_path / "s"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("would run:") == 7
    for s in ("optim.lr=0.0005 ", "optim.lr=0.004 ", "train.stop_after=768", "train.eval_depth=5",
              "data.val_path=default:screen", "--resume auto", f"--run-dir {tmp_path}/s/lr_0.00141"):
        assert s in out, s
    assert "train.max_steps" not in out  # the full run's horizon is kept
    assert "inside the LR warm-up" not in out  # S: warm-up 500 < stop 768
    assert cli.main(["--config", "S", "--out", str(tmp_path / "s"), "--dry-run", "--stop-after", "400"]) == 0
    assert "inside the LR warm-up" in capsys.readouterr().out
    assert not (tmp_path / "s").exists()  # a dry run writes nothing


def test_reused_out_is_checked_by_a_dry_run_too(tmp_path: Path, capsys) -> None:
    out = tmp_path / "s"
    grid = ["--config", "tiny", "--grid", "1e-3,2e-3,4e-3", "--out", str(out)]
    assert cli.main([*grid, "--stop-after", "4", "--collect", "--", "train.max_steps=6", "optim.warmup_steps=1"]) == 2
    assert "--collect: " in capsys.readouterr().err and not out.exists()  # nothing to collect, nothing made
    from megaloop.screen.core import build_screen

    args = cli.build_parser().parse_args([*grid, "--stop-after", "4"])
    screen = build_screen(args, ["train.max_steps=6", "optim.warmup_steps=1"])
    out.mkdir()
    (out / "screen.json").write_text(json.dumps(screen.fixed()))
    # the same overrides in another order are the same settings
    assert cli.main([*grid, "--stop-after", "4", "--dry-run", "--", "optim.warmup_steps=1", "train.max_steps=6"]) == 0
    capsys.readouterr()
    assert cli.main([*grid, "--stop-after", "5", "--dry-run", "--", "train.max_steps=6", "optim.warmup_steps=1"]) == 2
    err = capsys.readouterr().err
    assert "holds a screen with other settings (stop_after: 4 -> 5)" in err, err


def test_out_holding_a_reproduce_experiment_is_refused(tmp_path: Path, capsys) -> None:
    for marker, text in (("plan.json", "{}"), ("results.json", json.dumps({"experiment": "tbptt", "arms": []}))):
        out = tmp_path / marker.split(".")[0]
        out.mkdir()
        (out / marker).write_text(text)
        assert cli.main(["--config", "tiny", "--out", str(out), "--collect"]) == 2
        err = capsys.readouterr().err
        assert f"--out: {out} holds a `megaloop reproduce` result" in err, err
        assert sorted(p.name for p in out.iterdir()) == [marker]


@pytest.mark.parametrize("dry_run", [False, True])
def test_out_holding_a_run_or_model_is_refused(tmp_path: Path, capsys, dry_run: bool) -> None:
    """An RL run, a prefill student, a pretraining run or an HF model as --out: lr-screen used to accept it
    (its results and run folders written beside them), also in --dry-run."""
    folders = {"rl": ("megaloop_rl.json", "an RL run"), "student": ("student.json", "a prefill student"),
               "model": ("config.json", "a model (config.json)")}
    for name, (marker, named) in folders.items():
        out = tmp_path / name
        out.mkdir()
        (out / marker).write_text("{}")
        argv = ["--config", "tiny", "--out", str(out), "--grid", "1e-3,2e-3,4e-3", "--stop-after", "4"]
        assert cli.main([*argv, *(["--dry-run"] if dry_run else [])]) == 2
        err = capsys.readouterr().err
        assert f"--out: {out} holds {named}" in err and "not `megaloop lr-screen` results" in err, err
        assert sorted(p.name for p in out.iterdir()) == [marker]


def test_launcher_flags_reach_the_proposed_command() -> None:
    from megaloop.screen import report as rep
    from megaloop.screen.core import build_screen

    args = cli.build_parser().parse_args(["--config", "tiny", "--out", "/tmp/x", "--launcher", "slurm", "--wait",
                                          "--poll", "30", "--sbatch-arg=--partition=gpu",
                                          "--sbatch-arg=--account=abc", "--parallel", "2"])
    cmd = rep.proposal_command(args, build_screen(args, []), [5e-4, 1e-3, 2e-3])
    for flag in ("--launcher slurm", "--parallel 2", "--sbatch-arg=--partition=gpu", "--sbatch-arg=--account=abc",
                 "--wait", "--poll 30"):
        assert flag in cmd, cmd


@pytest.mark.parametrize("poll", ["-1", "0", "nan"])
def test_bad_poll_exits_2_before_anything_is_submitted(tmp_path: Path, capsys, poll) -> None:
    assert cli.main(["--config", "tiny", "--out", str(tmp_path / "s"), "--launcher", "slurm", "--wait",
                      "--poll", poll]) == 2
    assert "--poll: seconds between squeue polls, must be > 0" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


# ----------------------------------------------------------------------------------------- selection
def _pts(ces: list, statuses: list | None = None) -> list[dict]:
    lrs = [1e-3 * 2 ** i for i in range(len(ces))]
    statuses = statuses or ["done"] * len(ces)
    return [{"index": i, "lr": lr, "val_ce": ce, "status": st}
            for i, (lr, ce, st) in enumerate(zip(lrs, ces, statuses))]


def test_select_interior() -> None:
    sel = select_best(_pts([3.0, 2.5, 2.7]))
    assert sel["best_index"] == 1 and sel["interior"] and sel["edge"] is None
    assert sel["proposed_grid"] is None and sel["complete"]


def test_select_lower_edge_proposes_one_more_step() -> None:
    sel = select_best(_pts([2.0, 2.5, 2.7, 3.1]))
    assert sel["best_index"] == 0 and sel["interior"] is False and sel["edge"] == "lower"
    assert sel["proposed_grid"] == [0.0005, 0.001, 0.002, 0.004, 0.008]


def test_select_upper_edge() -> None:
    sel = select_best(_pts([3.0, 2.5, 2.1]))
    assert sel["edge"] == "upper" and sel["proposed_grid"][-1] == 0.008
    assert abs(sel["ratio"] - 2) < 1e-9


def test_diverged_top_point_brackets_the_optimum() -> None:
    sel = select_best(_pts([3.0, 2.5, 2.1, float("nan")], ["done", "done", "done", "diverged"]))
    assert sel["best_index"] == 2 and sel["interior"] and sel["complete"]


def test_a_screen_whose_every_point_diverged_proposes_a_lower_grid() -> None:
    sel = select_best(_pts([float("nan")] * 3, ["diverged"] * 3))
    assert sel["best_index"] is None and sel["complete"] and sel["all_diverged"]
    assert sel["edge"] == "lower" and sel["interior"] is False and sel["proposed_grid"] == [0.0005, 0.001, 0.002, 0.004]
    one = select_best(_pts([float("nan")], ["diverged"]))
    assert one["all_diverged"] and one["ratio"] == 10.0 and one["proposed_grid"] == [0.0001, 0.001]
    assert not select_best(_pts([3.0, float("nan")], ["done", "diverged"]))["all_diverged"]


def test_a_screen_whose_points_all_tie_claims_no_edge() -> None:
    """Exact ties (LRs too low to matter) were reported as the lowest LR on the lower edge, proposing
    lower LRs still."""
    sel = select_best(_pts([8.5, 8.5, 8.5]))
    assert sel["flat"] and sel["edge"] is None and sel["interior"] is False and sel["proposed_grid"] is None
    assert sel["best_index"] == 0 and sel["best_val_ce"] == 8.5
    sel = select_best(_pts([8.5, 8.5, float("nan")], ["done", "done", "diverged"]))
    assert sel["flat"] and sel["edge"] is None
    sel = select_best(_pts([8.5, 8.5, 8.7]))  # a partial tie still has an edge verdict
    assert not sel["flat"] and sel["edge"] == "lower"


def test_collect_of_a_tied_screen_says_so(tmp_path: Path, capsys) -> None:
    out = tmp_path / "scr"
    grid = [1e-12, 2e-12, 4e-12]
    for lr in grid:
        _metrics(out / f"lr_{lr_tag(lr)}", [{"step": 6, "loss": 8.5, "val_ce": 8.561177571614584}])
    argv = ["--config", "tiny", "--grid", ",".join(map(str, grid)), "--stop-after", "6", "--out", str(out), "--collect"]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "every finished point ties at val_ce 8.561178" in text and "EDGE" not in text, text
    assert json.loads((out / "results.json").read_text())["flat"] is True
    assert cli.main([*argv, "--fail-on-edge"]) == 3


def test_collect_of_an_all_diverged_screen_exits_non_zero(tmp_path: Path, capsys) -> None:
    """Every point diverged: it exited 0 ("no finished point yet", best None), with --fail-on-edge too."""
    out = tmp_path / "scr"
    grid = [1e-1, 1.0, 10.0]
    for lr in grid:
        _metrics(out / f"lr_{lr_tag(lr)}", [{"step": 6, "loss": float("nan"), "val_ce": float("nan")}])
    argv = ["--config", "tiny", "--grid", ",".join(map(str, grid)), "--stop-after", "6", "--out", str(out), "--collect"]
    assert cli.main(argv) == 1
    text = capsys.readouterr().out
    assert "every point of the grid DIVERGED" in text and "proposed grid: 0.01,0.1,1,10" in text, text
    assert "no finished point yet" not in text
    # strict JSON: the diverged points' NaN were written as bare NaN, which strict parsers refuse
    res = json.loads((out / "results.json").read_text(), parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))
    assert [p["val_ce"] for p in res["points"]] == [None, None, None]
    assert res["best"] is None and res["all_diverged"] is True and res["edge"] == "lower"
    assert res["proposed_grid"] == [0.01, 0.1, 1.0, 10.0] and "--grid 0.01,0.1,1,10" in res["proposed_command"]
    assert cli.main([*argv, "--fail-on-edge"]) == 3


def test_out_inside_a_dataset_is_refused_before_anything_is_written(tmp_path: Path, capsys) -> None:
    """--out inside the --screen-set (or data.path) wrote screen.json, lr_*/ and results into the MDS
    set, and every point then failed on its own run dir check (exit 1)."""
    screen_set = tmp_path / "screen"
    screen_set.mkdir()
    (screen_set / "index.json").write_text('{"shards": [], "version": 2}')
    (screen_set / "manifest.json").write_text(json.dumps({"kind": "screen", "seq_len": 128, "num_sequences": 20}))
    before = sorted(p.name for p in screen_set.iterdir())
    for out, words in ((screen_set, f"--out {screen_set} is the dataset --screen-set={screen_set}"),
                       (screen_set / "scr", f"--out {screen_set / 'scr'} is inside the dataset --screen-set")):
        for dry in ([], ["--dry-run"]):
            assert cli.main(["--config", "tiny", "--grid", "1e-3,2e-3,4e-3", "--stop-after", "2", "--out", str(out),
                             "--screen-set", str(screen_set), *dry]) == 2
            err = capsys.readouterr().err
            assert words in err and "nothing was written" in err and err.count("\n") == 1, err
    train = tmp_path / "train"
    train.mkdir()
    assert cli.main(["--config", "tiny", "--grid", "1e-3,2e-3,4e-3", "--stop-after", "2", "--out", str(train / "s"),
                     "--screen-set", str(screen_set), "--", f"data.path={train}"]) == 2
    assert f"is inside the dataset data.path={train}" in capsys.readouterr().err
    assert sorted(p.name for p in screen_set.iterdir()) == before and list(train.iterdir()) == []


def test_out_inside_a_read_only_dataset_is_named_as_inside_it(tmp_path: Path, capsys, monkeypatch) -> None:
    """The write probe ran before the dataset check: an --out inside a read-only dataset got "no file can
    be created" instead of "inside the dataset". (Root ignores file modes, so the probe is made to fail.)"""
    import megaloop.runtime.files as files

    monkeypatch.setattr(files, "cannot_create_in", lambda p: "Read-only file system")
    screen_set = tmp_path / "screen"
    screen_set.mkdir()
    (screen_set / "index.json").write_text('{"shards": [], "version": 2}')
    (screen_set / "manifest.json").write_text(json.dumps({"kind": "screen", "seq_len": 128, "num_sequences": 20}))
    train = tmp_path / "train"
    train.mkdir()
    argv = ["--config", "tiny", "--grid", "1e-3,2e-3,4e-3", "--stop-after", "2", "--screen-set", str(screen_set)]
    assert cli.main([*argv, "--out", str(train / "s"), "--", f"data.path={train}"]) == 2
    err = capsys.readouterr().err
    assert f"is inside the dataset data.path={train}" in err and "no file can be created" not in err, err
    assert cli.main([*argv, "--out", str(tmp_path / "elsewhere"), "--", f"data.path={train}"]) == 2
    assert "no file can be created in" in capsys.readouterr().err
    assert list(train.iterdir()) == [] and not (tmp_path / "elsewhere").exists()


def test_unfinished_points_make_selection_provisional() -> None:
    # a missing point may move the optimum: a provisional best, but no edge / interior verdict and no
    # proposed grid (an incomplete screen claimed an edge and proposed a grid)
    sel = select_best(_pts([3.0, None, 2.7], ["done", "pending", "done"]))
    assert sel["best_index"] == 2 and not sel["complete"] and sel["missing"] == [0.002]
    assert sel["edge"] is None and sel["interior"] is None and sel["proposed_grid"] is None
    sel = select_best(_pts([3.0, 2.5, None], ["done", "done", "queued"]))
    assert sel["best_index"] == 1 and sel["interior"] is None and sel["missing"] == [0.004]
    assert select_best(_pts([None, None, None], ["pending"] * 3))["best_index"] is None
    assert select_best(_pts([3.0, 2.5, 2.1]))["missing"] == []


def test_collect_of_an_incomplete_screen_claims_no_edge(tmp_path: Path, capsys) -> None:
    """1 of 3 points done (after an interrupt): --collect --fail-on-edge printed the LOWER EDGE warning,
    wrote edge / proposed_grid to results.json (and would have exited 3 had nothing been unfinished)."""
    out = tmp_path / "scr"
    grid = [1e-4, 2e-4, 4e-4]
    _metrics(out / f"lr_{lr_tag(grid[0])}", [{"step": 6, "loss": 4.0, "val_ce": 4.0, "val_ppl": math.exp(4.0),
                                             "val_depth": 5}])
    _metrics(out / f"lr_{lr_tag(grid[1])}", [{"step": 2, "loss": 4.5}])  # stopped at step 2
    code = cli.main(["--config", "tiny", "--grid", ",".join(map(str, grid)), "--stop-after", "6",
                     "--out", str(out), "--collect", "--fail-on-edge"])
    text = capsys.readouterr().out
    assert code == 1, text  # unfinished points, not an edge
    assert "EDGE" not in text and "proposed grid" not in text, text
    assert "incomplete (2 of 3 point(s) missing: lr 0.0002, 0.0004)" in text and "provisional" in text, text
    res = json.loads((out / "results.json").read_text())
    assert res["complete"] is False and res["edge"] is None and res["proposed_grid"] is None
    assert res["proposed_command"] is None and res["best"]["lr"] == 1e-4


def test_compress_indices() -> None:
    assert compress_indices([0, 1, 2]) == "0-2"
    assert compress_indices([5, 0, 2, 1, 7, 8]) == "0-2,5,7-8"


# ----------------------------------------------------------------------------------------- run state
def _metrics(run: Path, rows: list[dict], torn: bool = False) -> None:
    run.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (run / "metrics.jsonl").write_text(text + ('{"step": 9, "lo' if torn else ""))


def test_point_state(tmp_path: Path) -> None:
    assert point_state(tmp_path / "none", 6)["status"] == "pending"
    r = tmp_path / "done"
    _metrics(r, [{"step": s, "loss": 5.0} for s in range(1, 6)]
             + [{"step": 6, "loss": 4.0, "val_ce": 4.5, "val_ppl": 90.0, "val_depth": 5}], torn=True)
    st = point_state(r, 6)
    assert st["status"] == "done" and st["val_ce"] == 4.5 and st["steps"] == 6 and st["val_depth"] == 5
    # an intermediate evaluation (eval_interval) is not the final one
    r = tmp_path / "partial"
    _metrics(r, [{"step": 3, "loss": 5.0, "val_ce": 5.1}])
    assert point_state(r, 6)["status"] == "partial"
    (r / "screen_exit").write_text("75\n")
    assert point_state(r, 6)["status"] == "interrupted"
    (r / "screen_exit").write_text("-15\n")  # SIGTERM before the trainer's handler was installed
    assert point_state(r, 6)["status"] == "interrupted"
    (r / "screen_exit").write_text("1\n")
    assert point_state(r, 6)["status"] == "failed"
    (r / "train.log").write_text("Traceback ...\nNonFiniteLossError: non-finite loss at step 4\n")
    assert point_state(r, 6)["status"] == "diverged"
    r = tmp_path / "nan"
    _metrics(r, [{"step": 6, "loss": float("nan"), "val_ce": float("nan")}])
    assert point_state(r, 6)["status"] == "diverged"


def test_collect_only_writes_results_and_plot(tmp_path: Path, capsys) -> None:
    out = tmp_path / "scr"
    grid = [1e-4, 2e-4, 4e-4, 8e-4]
    for lr, ce in zip(grid, [5.0, 4.2, 4.4, float("nan")]):
        _metrics(out / f"lr_{lr_tag(lr)}", [{"step": 6, "loss": 4.0, "val_ce": ce, "val_ppl": math.exp(ce),
                                                  "val_depth": 5}])
    code = cli.main(["--config", "tiny", "--grid", ",".join(map(str, grid)), "--stop-after", "6",
                      "--out", str(out), "--collect"])
    text = capsys.readouterr().out
    assert code == 0, text
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert [r["status"] for r in rows] == ["done", "done", "done", "diverged"]
    assert {"lr", "val_ce", "val_ppl", "steps", "run_dir", "status"} <= set(rows[0])
    assert [r["best"] for r in rows] == ["0", "1", "0", "0"]
    res = json.loads((out / "results.json").read_text())
    assert res["best"]["lr"] == 2e-4 and res["interior"] is True and res["edge"] is None
    assert (out / "screen.png").stat().st_size > 1000
    assert "interior to the grid" in text
    # the screen's fixed settings cannot silently change in the same directory
    assert cli.main(["--config", "tiny", "--grid", ",".join(map(str, grid)), "--stop-after", "7",
                      "--out", str(out), "--collect"]) == 2
    assert "stop_after" in capsys.readouterr().err
    # nor be reused where a point trained another model (a default changed since, e.g. QK-norm)
    (out / f"lr_{lr_tag(grid[0])}" / "config.yaml").write_text("model:\n  qk_norm: false\n  embed_scale: sqrt_d\n")
    assert cli.main(["--config", "tiny", "--grid", ",".join(map(str, grid)), "--stop-after", "6",
                     "--out", str(out), "--collect"]) == 2
    err = capsys.readouterr().err
    assert "model.qk_norm: trained False, now True" in err and "embed_scale" not in err, err


# ----------------------------------------------------------------------------------------- real screen
SMALL = ["train.global_batch_size=8", "train.micro_batch_size=4", "optim.warmup_steps=1",
         "depth.warmup_updates=0", "train.save_interval=0"]


def _screen(out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megaloop.cli", "lr-screen", "--config", "tiny", "--grid", "1e-5,1e-4,1e-3",
           "--launcher", "local",
           "--stop-after", "4", "--eval-batches", "2", "--out", str(out), *extra, "--", *SMALL]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PYTHONWARNINGS": "ignore"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_real_tiny_screen_flags_edge_and_resumes(tmp_path: Path) -> None:
    out = tmp_path / "screen"
    proc = _screen(out)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-6000:]
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert [r["lr"] for r in rows] == ["1e-05", "0.0001", "0.001"]
    assert all(r["status"] == "done" and r["steps"] == "4" for r in rows), rows
    ces = [float(r["val_ce"]) for r in rows]
    assert all(math.isfinite(c) for c in ces)
    assert ces[2] < ces[0]  # 4 updates at 1e-3 beat 4 at 1e-5 by far: the top edge wins
    res = json.loads((out / "results.json").read_text())
    assert res["best"]["lr"] == 1e-3 and res["edge"] == "upper" and res["interior"] is False
    assert res["proposed_grid"] == [1e-5, 1e-4, 1e-3, 1e-2]
    assert "--grid 1e-05,0.0001,0.001,0.01" in res["proposed_command"]
    assert "UPPER EDGE" in text and "0.01" in text
    assert (out / "screen.png").stat().st_size > 1000
    for r in rows:  # each run: the screen set at depth 5, the full horizon kept
        last = json.loads(Path(r["run_dir"], "metrics.jsonl").read_text().splitlines()[-1])
        assert last["step"] == 4 and last["val_depth"] == 5
        cfg = Path(r["run_dir"], "config.yaml").read_text()
        assert "max_steps: 120" in cfg and "stop_after: 4" in cfg and "val_path: default:screen" in cfg
        assert Path(r["run_dir"], "checkpoints").is_dir()
    launches = (out / "launches.jsonl").read_text().splitlines()
    assert len(launches) == 3

    # rerun: every point is finished, nothing is launched
    t0 = time.time()
    again = _screen(out)
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.count("skip lr_") == 3 and "train lr_" not in again.stdout
    assert (out / "launches.jsonl").read_text().splitlines() == launches
    assert time.time() - t0 < 30

    # the proposed extension reuses the three finished runs: only the new point would run
    ext = _screen(out, "--dry-run")  # same settings, same grid: nothing to do
    assert "would run" not in ext.stdout
    cmd = [sys.executable, "-m", "megaloop.cli", "lr-screen", "--config", "tiny", "--grid", "1e-5,1e-4,1e-3,1e-2",
           "--stop-after",
           "4", "--eval-batches", "2", "--out", str(out), "--dry-run", "--", *SMALL]
    ext = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert ext.returncode == 0, ext.stderr
    assert ext.stdout.count("skip lr_") == 3 and ext.stdout.count("would run:") == 1
    assert "optim.lr=0.01 " in ext.stdout
