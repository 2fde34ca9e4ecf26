"""Experiment YAML validation (megaloop/repro/spec.py) through tools/reproduce.py: bad files exit 2
with one line naming the file and the arm, before anything runs; the shipped experiments are valid
at every scale and hold the paper's arms."""

from __future__ import annotations

from pathlib import Path

import pytest

from megaloop.repro.spec import EvalPlan, SpecError, load_plan, shipped_experiments
from megaloop.config import arm_overrides
from megaloop.config_utils import ConfigError
from tests.repro.conftest import USER_YAML


def _fail(tool, capsys, path: Path, *extra: str) -> str:
    code = tool.main(["--experiment", str(path), "--scale", "test", "--out", str(path.parent / "out"),
                      "--dry-run", *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("megaloop reproduce: error: ")
    assert not (path.parent / "out").exists()  # nothing written
    return err


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    return p


def test_unknown_override_key_names_file_and_arm(tool, capsys, tmp_path: Path) -> None:
    p = _write(tmp_path, USER_YAML.replace('b1: {label: "b=1", overrides: [model.bptt_window=1]}',
                                           'b1: "model.b_maximum=1"'))
    err = _fail(tool, capsys, p)
    assert str(p) in err and "arm 'b1'" in err and "b_maximum" in err


def test_bad_override_value_names_field(tool, capsys, tmp_path: Path) -> None:
    p = _write(tmp_path, USER_YAML.replace('full: "model.bptt_window=2"', 'full: "model.injection=nope"'))
    err = _fail(tool, capsys, p)
    assert "arm 'full'" in err and "model.injection" in err


def test_duplicate_arm_names(tool, capsys, tmp_path: Path) -> None:
    p = _write(tmp_path, USER_YAML.replace('  full: "model.bptt_window=2"\n', '  full: "model.bptt_window=2"\n  full: "model.bptt_window=3"\n'))
    err = _fail(tool, capsys, p)
    assert str(p) in err and "duplicate key 'full'" in err
    listed = USER_YAML.split("arms:")[0] + "arms:\n  - {name: a, overrides: model.bptt_window=2}\n  - {name: a, overrides: model.bptt_window=1}\n"
    err = _fail(tool, capsys, _write(tmp_path, listed))
    assert "arm 'a': duplicate arm name" in err


def test_empty_arms_and_empty_arm(tool, capsys, tmp_path: Path) -> None:
    no_arms = USER_YAML.split("arms:")[0] + "arms: {}\n"
    err = _fail(tool, capsys, _write(tmp_path, no_arms))
    assert "bad.yaml: arms: no arms defined" in err
    empty = USER_YAML.split("arms:")[0] + "arms:\n  full: \"model.bptt_window=2\"\n  b1:\n"
    err = _fail(tool, capsys, _write(tmp_path, empty))
    assert "arm 'b1': empty arm" in err


def test_arms_cannot_change_seed_data_or_budget(tool, capsys, tmp_path: Path) -> None:
    for ov in ("train.seed=7", "data.shuffle_seed=3", "train.max_steps=9", "train.global_batch_size=8"):
        p = _write(tmp_path, USER_YAML.replace('full: "model.bptt_window=2"', f'full: "model.bptt_window=2 {ov}"'))
        err = _fail(tool, capsys, p)
        assert "arm 'full'" in err and ov.split("=")[0] in err and "same for every arm" in err


def test_other_file_errors(tool, capsys, tmp_path: Path) -> None:
    assert "unknown key(s) armz" in _fail(tool, capsys, _write(tmp_path, USER_YAML + "armz: {}\n"))
    assert "no scale 'test'" in _fail(tool, capsys, _write(tmp_path, USER_YAML.replace("  test:", "  tst:")))
    assert "arm 'a b'" in _fail(tool, capsys, _write(tmp_path, USER_YAML.replace("  b1:", "  a b:")))
    bad_claim = USER_YAML.replace("arms: [b1], relative_to: full", "arms: [b1], relative_to: nope")
    assert "claims[1]: arm 'nope'" in _fail(tool, capsys, _write(tmp_path, bad_claim))
    assert "eval.depths" in _fail(tool, capsys, _write(tmp_path, USER_YAML.replace("depths: [1, 2, 4]", "depths: []")))
    assert "not valid YAML" in _fail(tool, capsys, _write(tmp_path, "arms: [\n"))
    err = _fail(tool, capsys, _write(tmp_path, USER_YAML), "--arms", "full,zzz")
    assert "--arms: 'zzz'" in err
    missing = tmp_path / "none.yaml"
    code = tool.main(["--experiment", str(missing), "--dry-run"])
    assert code == 2 and "does not exist" in capsys.readouterr().err


def test_command_line_overrides_are_validated_per_arm(tool, capsys, tmp_path: Path) -> None:
    p = _write(tmp_path, USER_YAML)
    err = _fail(tool, capsys, p, "--", "model.hidden_size=-3")
    assert "arm 'full'" in err and "model.hidden_size" in err


def test_plan_resolution(user_yaml: Path) -> None:
    plan = load_plan(str(user_yaml), "test", ["train.stop_after=1"], {"max_seqs": 3})
    full, b1 = plan.arms
    assert (full.name, b1.label) == ("full", "b=1")
    # order: scale, common, arm, command line, the tool's
    assert full.overrides[:4] == ["train.max_steps=2", "optim.warmup_steps=1", "train.save_interval=1",
                                  "train.eval_batches=1"]
    assert full.overrides[4:7] == ["depth.kind=fixed", "depth.depth=2", "model.bptt_window=2"]
    assert full.overrides[7] == "train.stop_after=1" and "train.eval_depth=2" in full.overrides
    assert plan.eval.max_seqs == 3 and plan.eval.depths == [1, 2, 4] and plan.eval.depth == 2
    assert plan.settings["max_steps"] == 2 and plan.settings["tokens_per_step"] == 16 * 128
    assert EvalPlan(depth=5, depths=[1, 64]).depths == [1, 5, 64]  # the training depth is always a row
    assert plan.eval.digest() != EvalPlan(depth=2, depths=[1, 2, 4], max_seqs=4, harness_limit=2,
                                          batch_size=2).digest()
    with pytest.raises(ConfigError):
        EvalPlan(depth=0)
    with pytest.raises(SpecError, match="--arms"):
        load_plan(str(user_yaml), "test", only=["nope"])


EXPECTED_ARMS = {
    "tbptt": {"huginn_bR", "huginn_b2", "huginn_b4", "parcae_bR", "parcae_b2", "parcae_b4"},
    "depth": {"fixed5", "pln5", "learned_h0", "learned_h0.01", "learned_h0.05", "learned_h0.1", "uniform64",
              "uniform10"},
    "injections": {"huginn_linear", "parcae_decay", "parcae_nonorm", "orthoinj", "deq_qkv"},
    "untied": {"looped", "untied4", "untied12"},
}


@pytest.mark.parametrize("name", sorted(EXPECTED_ARMS))
def test_shipped_experiments(name: str) -> None:
    assert set(shipped_experiments()) == set(EXPECTED_ARMS)
    plans = {s: load_plan(name, s) for s in ("tiny", "S", "M", "L")}
    for scale, plan in plans.items():
        assert {a.name for a in plan.arms} == EXPECTED_ARMS[name], scale
        assert plan.eval.depth == 5 and max(plan.eval.depths) == 64 and plan.eval.sharing
        assert plan.claims and all(c.id.startswith("C") for c in plan.claims)
        assert all(c.expect for c in plan.claims)  # every claim row gets a computed verdict
    tiny = plans["tiny"]
    assert tiny.config == "tiny" and 250 <= tiny.settings["max_steps"] <= 600 and tiny.eval.max_seqs
    assert plans["S"].settings["max_steps"] == 20000 and plans["L"].settings["global_batch_size"] == 1024
    arms = {a.name: a for a in tiny.arms}
    if name == "tbptt":
        assert all(a.depth_kind == "fixed" and "depth.depth=5" in a.overrides for a in tiny.arms)
        assert "model.bptt_window=5" in arms["huginn_bR"].overrides and "model.bptt_window=2" in arms["parcae_b2"].overrides
    if name == "depth":
        assert [a.overrides for a in tiny.arms if a.name == "learned_h0.05"][0].count("depth.entropy_coef=0.05") == 1
        assert "depth.init=uniform_1_10" in arms["uniform10"].overrides
    if name == "untied":
        assert not arms["untied12"].looped and "model.num_layers=12" in arms["untied12"].overrides
        # they set depth.depth=5, which an untied model logged without running it (now refused)
        assert all("depth.depth=5" not in arms[a].overrides for a in ("untied4", "untied12"))
    # the synthetic-task scale: the synth preset, no PPL sweep, held-out answers at every depth
    synth = load_plan(name, "synth")
    assert synth.config == "synth" and {a.name for a in synth.arms} == EXPECTED_ARMS[name]
    assert not synth.eval.sweep and synth.eval.synth and synth.eval.synth_min_k == 3 and not synth.eval.harness
    assert max(synth.eval.depths) == 64 and 1 in synth.eval.depths
    if name != "tbptt":  # the synth preset's b=2 over the paper arms' 10, as the tiny scale keeps 4
        assert all("model.bptt_window=2" in a.overrides for a in synth.arms if a.looped)
    # every shipped arm is a paper arm of megaloop/configs/arms.yaml, whose overrides come first
    for arm in tiny.arms:
        assert arm.paper_arm and arm.overrides[:len(arm_overrides(arm.paper_arm))] == arm_overrides(arm.paper_arm)


def test_arm_names_a_paper_arm(tool, capsys, tmp_path: Path, user_yaml: Path) -> None:
    p = _write(tmp_path, USER_YAML.replace('full: "model.bptt_window=2"', "full: {arm: fixed5_b2, overrides: model.bptt_window=3}"))
    full = load_plan(str(p), "test").arm("full")
    assert full.paper_arm == "fixed5_b2" and full.overrides[:4] == arm_overrides("fixed5_b2")
    # then the scale's, common, the arm's own (its bptt_window wins over the paper arm's), the tool's
    assert full.overrides[4:6] == ["train.max_steps=2", "optim.warmup_steps=1"]
    assert full.overrides[8:11] == ["depth.kind=fixed", "depth.depth=2", "model.bptt_window=3"]
    assert load_plan(str(user_yaml), "test").arm("full").paper_arm is None
    err = _fail(tool, capsys, _write(tmp_path, USER_YAML.replace('full: "model.bptt_window=2"', "full: {arm: nope}")))
    assert "arm 'full': arm: 'nope' is not an arm of arms.yaml" in err


def test_synth_eval_plan_fields_and_digest_stability() -> None:
    """The synthetic-task fields are validated, and a plan that does not use them keeps the digest
    it had before they existed (results made then are not re-evaluated)."""
    import hashlib
    import json
    from dataclasses import asdict

    plain = EvalPlan(depth=2, depths=[1, 2, 4])
    old = {k: v for k, v in asdict(plain).items() if k not in ("sweep", "synth", "synth_min_k")}
    assert plain.digest() == hashlib.sha256(json.dumps(old, sort_keys=True).encode()).hexdigest()[:16]
    synth = EvalPlan(depth=2, depths=[1, 2, 4], sweep=False, harness=[], synth="shipped")
    assert synth.digest() != plain.digest() and synth.to_dict()["synth_min_k"] == 3
    for kw, field in (({"sweep": "no"}, "eval.sweep"), ({"synth": ""}, "eval.synth"),
                      ({"synth": "x.jsonl", "synth_min_k": 0}, "eval.synth_min_k"),
                      ({"sweep": False, "harness": []}, "nothing to evaluate")):
        with pytest.raises(ConfigError, match=field):
            EvalPlan(**kw)


def test_a_run_train_would_refuse_is_named_while_planning() -> None:
    """The warm-up/WSD-decay overlap and stop_after past the horizon are refused when a run starts; a
    plan (and with slurm, every queued job) only met them there."""
    with pytest.raises(SpecError, match=r"arm 'huginn_bR': optim.warmup_steps: 30 warm-up steps and the WSD decay"):
        load_plan("tbptt", "tiny", ["train.max_steps=32"])


def test_an_arms_scales_may_only_name_the_files_scales(tool, capsys, tmp_path: Path) -> None:
    """A typo (`tnyi:`) dropped the arm's overrides at every scale, silently (exit 0)."""
    p = _write(tmp_path, USER_YAML.replace('b1: {label: "b=1", overrides: [model.bptt_window=1]}',
                                           'b1: {overrides: [model.bptt_window=1], scales: {tset: "model.qk_norm=false"}}'))
    err = _fail(tool, capsys, p)
    assert "arm 'b1': scales.tset: not a scale of this file (its scales: test)" in err
    bad = USER_YAML.replace('b1: {label: "b=1", overrides: [model.bptt_window=1]}',
                            'b1: {overrides: [model.bptt_window=1], scales: {test: "x"}}')
    assert "scales.test: override 'x' is not section.key=value" in _fail(tool, capsys, _write(tmp_path, bad))


def test_command_line_overrides_may_not_replace_an_arms_own(tool, capsys, tmp_path: Path) -> None:
    """`-- model.bptt_window=4` replaced what made each arm that arm, keeping its label (exit 0)."""
    p = _write(tmp_path, USER_YAML)
    err = _fail(tool, capsys, p, "--", "model.bptt_window=4")
    assert f"command-line override model.bptt_window: arm 'full' of {p} sets it itself" in err
    assert "command-line override model.bptt_window: arm 'full'" in _fail(tool, capsys, p, "--", "model.b_max=4")
    # settings the arms leave to the file (common:, the scale's) may still be overridden for every arm
    assert [a.overrides[-4] for a in load_plan(str(p), "test", ["depth.depth=3"]).arms] == ["depth.depth=3"] * 2


@pytest.mark.parametrize("eval_yaml, words", [
    ("{depth: 2, data: /no/such/val}", "eval.data: /no/such/val is no MDS validation folder or text file"),
    ("{depth: 2, synth: /no/such.jsonl}", "eval.synth: /no/such.jsonl is not a file"),
    ("{depth: 2, harness: [nosuchtask]}", "eval.harness: --tasks: unknown task(s) ['nosuchtask']"),
    ("{depth: 2}", "eval.batch_size: must be an integer >= 1, got True"),
])
def test_a_bad_eval_plan_is_refused_before_any_arm_trains(tool, capsys, tmp_path: Path, eval_yaml, words) -> None:
    """Each was accepted, every arm trained, and the evaluation then failed (exit 1)."""
    text = USER_YAML.replace("eval: {depth: 2}", f"eval: {eval_yaml}")
    if "batch_size" in words:
        text = text.replace("batch_size: 2}", "batch_size: true}")
    path = _write(tmp_path, text)
    if "/no/such" in eval_yaml:  # files: checked when it runs; --dry-run prints the plan (data may come later)
        assert tool.main(["--experiment", str(path), "--scale", "test", "--dry-run", "--out", str(tmp_path / "o")]) == 0
        capsys.readouterr()
        assert tool.main(["--experiment", str(path), "--scale", "test", "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert not (tmp_path / "out").exists()
    else:
        err = _fail(tool, capsys, path)
    assert words in err, err


@pytest.mark.parametrize("data", ["default:screen", "val.txt", "val.jsonl.gz", "valdir"])
def test_every_eval_data_the_evaluator_takes_is_accepted(tmp_path: Path, data) -> None:
    from megaloop.repro.evaluate import check_eval_inputs

    if not data.startswith("default"):
        (tmp_path / data).mkdir() if data == "valdir" else (tmp_path / data).write_text("x")
        data = str(tmp_path / data)
    check_eval_inputs(EvalPlan(data=data), "spec.yaml")


def test_a_synthetic_tree_of_generator_1_is_warned_about_before_training(tmp_path: Path, capsys) -> None:
    """A reproduce on an old tree (held-out answers in its training programs) said so only in each arm's
    evaluation log, after training."""
    import json

    from megaloop.repro.evaluate import check_eval_inputs

    (tmp_path / "heldout.jsonl").write_text("{}\n")
    (tmp_path / "synth.json").write_text(json.dumps({"heldout": {"file": "heldout.jsonl"}}))
    check_eval_inputs(EvalPlan(synth=str(tmp_path / "heldout.jsonl")), "spec.yaml")
    assert f"warning: {tmp_path} was made by an earlier make_synth.py" in capsys.readouterr().err
    (tmp_path / "synth.json").write_text(json.dumps({"generator": 2, "heldout": {"file": "heldout.jsonl"}}))
    check_eval_inputs(EvalPlan(synth=str(tmp_path / "heldout.jsonl")), "spec.yaml")
    assert "earlier make_synth.py" not in capsys.readouterr().err


def test_an_unknown_embedded_split_is_refused_even_in_a_dry_run() -> None:
    from megaloop.repro.evaluate import check_eval_inputs

    for files in (True, False):
        with pytest.raises(SpecError, match=r"eval.data: unknown embedded split 'default:valx'"):
            check_eval_inputs(EvalPlan(data="default:valx"), "spec.yaml", files=files)


def test_yaml_errors_name_the_line_and_a_folder_is_not_missing(tool, capsys, tmp_path: Path) -> None:
    p = _write(tmp_path, USER_YAML.replace('b1: {label: "b=1", overrides: [model.bptt_window=1]}',
                                           'b1: {label: "b=1" overrides: [model.bptt_window=1]}'))
    err = _fail(tool, capsys, p)
    assert f"{p}: not valid YAML (line 12, column " in err and "expected ',' or '}'" in err, err
    assert tool.main(["--experiment", str(tmp_path), "--dry-run"]) == 2
    assert f"--experiment: {tmp_path} is a directory, not an experiment YAML" in capsys.readouterr().err


def test_a_typo_in_common_is_named_there(tool, capsys, tmp_path: Path) -> None:
    """It was blamed on the first arm (`arm 'full': trian: unknown field`)."""
    err = _fail(tool, capsys, _write(tmp_path, USER_YAML.replace('common: "depth.kind=fixed depth.depth=2"',
                                                                 'common: "depth.kind=fixed trian.seed=3"')))
    assert "bad.yaml: common: trian.seed: unknown field" in err and "arm" not in err, err
