"""Merging the results of one experiment run at different seeds (megaloop/repro/merge.py,
``megaloop reproduce --render A --merge B --out DIR``): runs pooled per arm, verdicts over the whole
spread, mismatches refused naming the file, the inputs never rewritten."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.repro.test_report import RESULTS, _arm


def _file(tmp_path: Path, name: str, seeds: list[int] | None, ppl: dict[str, list[float]], **settings) -> Path:
    """A results.json of arms orthoinj / parcae_decay; ``seeds=None``: the unseeded layout (one run per
    arm at settings.seed, named by the arm, as `megaloop reproduce` without a seed list writes it)."""
    res = json.loads(json.dumps(RESULTS))
    res["settings"].update(settings)
    res["seeds"] = seeds
    res["claims"] = [{"id": "C10", "claim": "c", "paper": "p", "metrics": ["terminal_ppl"], "arms": ["orthoinj"],
                      "relative_to": "parcae_decay",
                      "expect": [{"arm": "orthoinj", "metric": "terminal_ppl", "vs": "parcae_decay", "op": "<"}]}]
    res["arms"] = []
    for group, label in (("orthoinj", "OrthoInj"), ("parcae_decay", "Parcae-Decay")):
        for i, p in enumerate(ppl[group]):
            seed = None if seeds is None else seeds[i]
            a = _arm(group if seed is None else f"{group}.seed{seed}", label, True, terminal_ppl=p, native_ppl=p)
            a.update(group=group, seed=seed, run_dir=f"arms/{a['name']}",
                     overrides=[f"model.injection={group}", f"logging.name=repro-{a['name']}"]
                     + ([] if seed is None else [f"train.seed={seed}"]))
            res["arms"].append(a)
    path = tmp_path / name / "results.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(res))
    return path


def test_merge_pools_seeds_and_computes_verdicts_over_all(tool, tmp_path: Path, capsys) -> None:
    a = _file(tmp_path, "a", None, {"orthoinj": [100.0], "parcae_decay": [110.0]})  # settings.seed 1234
    b = _file(tmp_path, "b", [1, 2], {"orthoinj": [101.0, 99.0], "parcae_decay": [111.0, 112.0]})
    before = (a.read_text(), b.read_text())
    out = tmp_path / "ab"
    assert tool.main(["--render", str(a), "--merge", str(b), "--out", str(out)]) == 0
    assert "C10: holds (3 seeds)" in capsys.readouterr().out
    merged = json.loads((out / "results.json").read_text())
    assert merged["seeds"] == merged["settings"]["seeds"] == [1234, 1, 2]
    assert [x["name"] for x in merged["arms"]] == ["orthoinj.seed1234", "orthoinj.seed1", "orthoinj.seed2",
                                                   "parcae_decay.seed1234", "parcae_decay.seed1", "parcae_decay.seed2"]
    assert merged["arms"][0]["run_dir"] == "../a/arms/orthoinj" and merged["arms"][1]["run_dir"] == "../b/arms/orthoinj.seed1"
    assert merged["verdicts"][0]["verdict"] == "holds"
    md = (out / "report.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| OrthoInj"))
    assert "100.00 ± 1.00" in row  # mean ± sample sd of 100, 101, 99
    assert (a.read_text(), b.read_text()) == before  # the inputs are untouched


def test_merge_refusals_name_the_file(tool, tmp_path: Path, capsys) -> None:
    a = _file(tmp_path, "a", [1], {"orthoinj": [100.0], "parcae_decay": [110.0]})
    same = _file(tmp_path, "same", [1, 2], {"orthoinj": [100.0, 1.0], "parcae_decay": [110.0, 1.0]})
    budget = _file(tmp_path, "budget", [2], {"orthoinj": [100.0], "parcae_decay": [110.0]}, max_steps=9)
    other = _file(tmp_path, "other", [2], {"orthoinj": [100.0], "parcae_decay": [110.0]})
    res = json.loads(other.read_text())
    res["arms"][0]["overrides"].append("model.qk_norm=true")
    other.write_text(json.dumps(res))
    cases = [
        (["--render", str(a), "--merge", str(same), "--out", str(tmp_path / "x")],
         f"arm 'orthoinj' at seed 1 is in both {a.resolve()} and {same}"),
        (["--render", str(a), "--merge", str(budget), "--out", str(tmp_path / "x")],
         f"{budget} differs from {a} in settings ['max_steps']"),
        (["--render", str(a), "--merge", str(other), "--out", str(tmp_path / "x")],
         f"arm 'orthoinj' resolves to another config in {other} than in {a}: model.qk_norm False vs True"),
        (["--render", str(a), "--merge", str(same)], "--merge: needs --out"),
        (["--render", str(a), "--merge", str(same), "--out", str(a.parent)], "holds one of the merged files"),
        (["--merge", str(same), "--out", str(tmp_path / "x")], "--merge: goes with --render"),
    ]
    for argv, message in cases:
        assert tool.main(argv) == 2, argv
        assert message in capsys.readouterr().err, argv
    assert not (tmp_path / "x").exists()  # nothing written for a refused merge


@pytest.mark.parametrize("field", ["experiment", "scale"])
def test_merge_needs_the_same_experiment(tool, tmp_path: Path, capsys, field: str) -> None:
    a = _file(tmp_path, "a", [1], {"orthoinj": [100.0], "parcae_decay": [110.0]})
    b = _file(tmp_path, "b", [2], {"orthoinj": [100.0], "parcae_decay": [110.0]})
    res = json.loads(b.read_text())
    res[field] = "other"
    b.write_text(json.dumps(res))
    assert tool.main(["--render", str(a), "--merge", str(b), "--out", str(tmp_path / "x")]) == 2
    assert f"{b} is {field} 'other'" in capsys.readouterr().err


def test_merge_compares_resolved_configs_not_spellings(tool, tmp_path: Path, capsys) -> None:
    """Another launcher's spelling of the same config (old field name, an override listed twice,
    a default written out) merges; an override that does not resolve is refused naming the file."""
    a = _file(tmp_path, "a", [1], {"orthoinj": [100.0], "parcae_decay": [110.0]})
    b = _file(tmp_path, "b", [2], {"orthoinj": [101.0], "parcae_decay": [111.0]})
    res = json.loads(b.read_text())
    res["arms"][0]["overrides"] = ["model.b_max=10", "model.injection=parcae_decay", "model.qk_norm=false",
                                   "model.injection=orthoinj", "model.b_max=4", "train.seed=2"]
    b.write_text(json.dumps(res))
    assert tool.main(["--render", str(a), "--merge", str(b), "--out", str(tmp_path / "ab")]) == 0
    assert "(2 seeds)" in capsys.readouterr().out
    res["arms"][0]["overrides"].append("model.no_such_field=1")
    b.write_text(json.dumps(res))
    assert tool.main(["--render", str(a), "--merge", str(b), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert f"--merge: {b}: arm 'orthoinj' does not resolve on config 'tiny'" in err and "no_such_field" in err
    assert not (tmp_path / "x").exists()


def test_results_of_an_earlier_defaults_revision_resolve_to_the_model_they_trained(tool, tmp_path: Path,
                                                                                  capsys) -> None:
    """A file written before model.qk_norm became the default (no ``defaults_revision``: revision 1)
    trained without QK-norm: it merges with today's runs that pin ``model.qk_norm=false`` (the tiny
    scales' pin) and is refused against today's default, naming the field; the merged file keeps
    each run's revision, so merging it again resolves the same way."""
    from megaloop.model.config import ModelConfig

    assert ModelConfig.DEFAULTS_REVISION == 2 and ModelConfig.qk_norm is True
    old = _file(tmp_path, "old", [1], {"orthoinj": [100.0], "parcae_decay": [110.0]})
    assert "defaults_revision" not in json.loads(old.read_text())

    def today(name: str, seed: int, pin: bool) -> Path:
        p = _file(tmp_path, name, [seed], {"orthoinj": [101.0], "parcae_decay": [111.0]})
        res = json.loads(p.read_text())
        res["defaults_revision"] = ModelConfig.DEFAULTS_REVISION
        for a in res["arms"]:
            a["overrides"] += ["model.qk_norm=false"] if pin else []
        p.write_text(json.dumps(res))
        return p

    pinned, unpinned = today("pinned", 2, True), today("unpinned", 3, False)
    assert tool.main(["--render", str(old), "--merge", str(pinned), "--out", str(tmp_path / "m")]) == 0
    merged = json.loads((tmp_path / "m" / "results.json").read_text())
    assert {(a["seed"], a["defaults_revision"]) for a in merged["arms"]} == {(1, 1), (2, 2)}
    capsys.readouterr()
    for first in (old, tmp_path / "m" / "results.json"):
        assert tool.main(["--render", str(first), "--merge", str(unpinned), "--out", str(tmp_path / "x")]) == 2
        assert "model.qk_norm False vs True" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_previous_defaults_sit_under_the_preset_and_the_overrides(tmp_path: Path) -> None:
    """Revision 1's QK-norm-off default applies only where neither the preset nor the arm sets it."""
    from megaloop.config import resolve_config_path
    from megaloop.repro.merge import _resolved

    own = tmp_path / "qk.yaml"
    own.write_text(f"base: {resolve_config_path('tiny')}\nmodel:\n  qk_norm: true\n")

    def qk(config: str, overrides: list[str], revision: int) -> bool:
        return _resolved(config, overrides, tmp_path, "a", revision)["model.qk_norm"]

    assert (qk("tiny", [], 1), qk("tiny", [], 2)) == (False, True)
    assert qk("tiny", ["model.qk_norm=true"], 1) is True
    assert qk(str(own), [], 1) is True  # the preset said so; the old default did not apply


def test_an_untied_arms_depth_setting_does_not_split_a_merge(tmp_path: Path) -> None:
    """The committed untied results set depth.depth=5 on their untied arms (which never ran it); the shipped
    experiment no longer does (now refused), and --merge refused new seeds: "depth.depth 5 vs 1"."""
    from megaloop.repro.merge import _resolved

    arm = ["model.arch=untied", "model.num_layers=4", "depth.kind=fixed", "depth.depth=1"]
    assert _resolved("tiny", arm + ["depth.depth=5"], tmp_path, "untied4", 2) == _resolved("tiny", arm, tmp_path, "untied4", 2)
    looped = ["depth.kind=fixed"]  # a looped arm's depth still counts
    assert _resolved("tiny", looped + ["depth.depth=5"], tmp_path, "a", 2) != _resolved("tiny", looped + ["depth.depth=4"],
                                                                                       tmp_path, "a", 2)


def test_merge_refuses_runs_trained_on_other_data(tool, tmp_path: Path, capsys) -> None:
    """Runs that recorded their data's content fingerprint (data.json) merge only when it is the same;
    a file written before the fingerprint was recorded merges with either."""
    def with_data(path: Path, sha: str | None) -> Path:
        res = json.loads(path.read_text())
        for a in res["arms"]:
            a["data"] = sha
        path.write_text(json.dumps(res))
        return path

    a = with_data(_file(tmp_path, "a", [1], {"orthoinj": [100.0], "parcae_decay": [110.0]}), "a" * 64)
    b = with_data(_file(tmp_path, "b", [2], {"orthoinj": [101.0], "parcae_decay": [111.0]}), "a" * 64)
    old = _file(tmp_path, "old", [3], {"orthoinj": [99.0], "parcae_decay": [112.0]})  # no "data" recorded
    other = with_data(_file(tmp_path, "other", [4], {"orthoinj": [99.0], "parcae_decay": [112.0]}), "b" * 64)
    assert tool.main(["--render", str(a), "--merge", str(b), "--merge", str(old), "--out", str(tmp_path / "ab")]) == 0
    assert "(3 seeds)" in capsys.readouterr().out
    assert tool.main(["--render", str(a), "--merge", str(other), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "trained on different data" in err and "aaaaaaaaaaaa" in err and "bbbbbbbbbbbb" in err
    assert str(other.resolve()) in err
    assert not (tmp_path / "x").exists()


def test_an_out_holding_another_result_is_never_overwritten(tool, tmp_path: Path, capsys) -> None:
    a = _file(tmp_path, "a", [1], {"orthoinj": [100.0], "parcae_decay": [110.0]})
    b = _file(tmp_path, "b", [2], {"orthoinj": [101.0], "parcae_decay": [111.0]})
    screen = tmp_path / "screen"  # an LR screen's folder
    screen.mkdir()
    (screen / "screen.json").write_text("{}")
    (screen / "results.json").write_text(json.dumps({"grid": [1e-3], "points": []}))
    other = _file(tmp_path, "other", [3], {"orthoinj": [1.0], "parcae_decay": [2.0]})  # another result
    expt = tmp_path / "expt"  # an experiment folder (plan.json) of another run
    expt.mkdir()
    (expt / "plan.json").write_text("{}")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    cases = [
        (["--render", str(a), "--merge", str(b), "--out", str(screen)], "holds a `megaloop lr-screen` result"),
        (["--render", str(a), "--merge", str(b), "--out", str(other.parent)], "holds another result"),
        (["--render", str(a), "--out", str(other.parent)], "holds another result"),
        (["--render", str(a), "--out", str(expt)], "is an experiment folder (plan.json) that holds none of the inputs"),
        (["--render", str(a), "--depths", "1,5"], "--depths: does not apply to --render"),
        (["--render", str(a), "--arms", "orthoinj"], "--arms: does not apply to --render"),
    ]
    for argv, message in cases:
        assert tool.main(argv) == 2, argv
        assert message in capsys.readouterr().err, argv
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    # a merge may replace an earlier merged result in its own folder
    out = tmp_path / "ab"
    assert tool.main(["--render", str(a), "--merge", str(b), "--out", str(out)]) == 0
    assert tool.main(["--render", str(a), "--merge", str(b), "--out", str(out)]) == 0
    capsys.readouterr()


def test_render_with_an_experiment_into_another_out_leaves_the_input_alone(tool, tmp_path: Path, capsys) -> None:
    src = ROOT / "tools" / "reproduce_results" / "tbptt_tiny" / "results.json"
    a = tmp_path / "a" / "results.json"
    a.parent.mkdir()
    a.write_bytes(src.read_bytes())
    out = tmp_path / "elsewhere"
    assert tool.main(["--render", str(a), "--experiment", "tbptt", "--out", str(out)]) == 0
    assert a.read_bytes() == src.read_bytes()  # the input is not rewritten
    assert (out / "results.json").is_file() and (out / "report.md").is_file()
    assert f"wrote {out / 'results.json'}" in capsys.readouterr().out


def test_render_into_its_own_out_again_is_accepted_another_input_is_not(tool, tmp_path: Path, capsys) -> None:
    """`--render A --experiment E --out X` run twice (say after editing E's claims) re-renders X; it was
    refused as "holds another result". A render of another input into X still is."""
    src = ROOT / "tools" / "reproduce_results" / "tbptt_tiny" / "results.json"
    a, b = tmp_path / "a" / "results.json", tmp_path / "b" / "results.json"
    for p in (a, b):
        p.parent.mkdir()
        p.write_bytes(src.read_bytes())
    out = tmp_path / "x"
    argv = ["--render", str(a), "--experiment", "tbptt", "--out", str(out)]
    assert tool.main(argv) == 0 and tool.main(argv) == 0
    assert json.loads((out / "results.json").read_text())["rendered_from"] == str(a.resolve())
    held = (out / "results.json").read_bytes()
    capsys.readouterr()
    assert tool.main(["--render", str(b), "--experiment", "tbptt", "--out", str(out)]) == 2
    assert "holds another result" in capsys.readouterr().err
    assert (out / "results.json").read_bytes() == held
    # a merged result (it carried its first input's rendered_from) is no copy of `a`: not replaced by one
    merged = tmp_path / "m"
    merged.mkdir()
    res = json.loads(src.read_text())
    res["rendered_from"], res["launcher"] = str(a.resolve()), {**(res.get("launcher") or {}), "merged": True}
    (merged / "results.json").write_text(json.dumps(res))
    assert tool.main(["--render", str(a), "--experiment", "tbptt", "--out", str(merged)]) == 2
    assert "holds another result" in capsys.readouterr().err


def test_written_results_are_strict_json_a_diverged_metric_is_null(tool, tmp_path: Path, capsys) -> None:
    """A diverged arm's NaN was written as a bare NaN, which strict JSON parsers refuse; it is null,
    read back as missing ("—"), as every eval JSON writes it."""
    a = _file(tmp_path, "a", [1], {"orthoinj": [float("nan")], "parcae_decay": [110.0]})
    b = _file(tmp_path, "b", [2], {"orthoinj": [101.0], "parcae_decay": [111.0]})
    out = tmp_path / "ab"
    assert tool.main(["--render", str(a), "--merge", str(b), "--out", str(out)]) == 0

    def strict(text: str) -> None:
        raise AssertionError(f"non-strict JSON constant {text}")
    merged = json.loads((out / "results.json").read_text(), parse_constant=strict)
    assert merged["arms"][0]["metrics"]["terminal_ppl"] is None
    capsys.readouterr()
    assert tool.main(["--render", str(out / "results.json")]) == 0  # and it renders again


def test_render_with_an_experiment_leaves_out_the_claims_of_arms_not_held(tool, tmp_path: Path, capsys) -> None:
    res = json.loads((ROOT / "tools" / "reproduce_results" / "tbptt_tiny" / "results.json").read_text())
    res["arms"] = [a for a in res["arms"] if a["name"] in ("huginn_bR", "parcae_bR")]
    a = tmp_path / "a" / "results.json"
    a.parent.mkdir()
    a.write_text(json.dumps(res))
    assert tool.main(["--render", str(a), "--experiment", "tbptt"]) == 0
    assert "claims C2, C3" in capsys.readouterr().out
    assert {c["id"] for c in json.loads(a.read_text())["claims"]} == {"C1"}


def test_render_with_another_experiment_is_refused(tool, tmp_path: Path, capsys) -> None:
    """--render TBPTT --experiment depth kept tbptt's title but swapped in depth's claims (none held),
    dropping tbptt's own C1-C3 and their verdicts without a word."""
    src = ROOT / "tools" / "reproduce_results" / "tbptt_tiny" / "results.json"
    a = tmp_path / "a" / "results.json"
    a.parent.mkdir()
    a.write_bytes(src.read_bytes())
    assert tool.main(["--render", str(a), "--experiment", "depth", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "--experiment: depth (experiment 'depth') has no arm huginn_b2, huginn_b4" in err and "(experiment 'tbptt')" in err, err
    assert not (tmp_path / "x").exists() and a.read_bytes() == src.read_bytes()


def test_render_into_an_out_no_file_can_be_created_in_is_one_line(tool, tmp_path: Path, capsys, monkeypatch) -> None:
    """The write probe moved after the dataset check left --render (and --evaluate-arm) unprobed: a
    PermissionError traceback from the report's temporary folder instead of one line (review)."""
    import megaloop.runtime.files as files

    a = _file(tmp_path, "a", None, {"orthoinj": [100.0], "parcae_decay": [110.0]})
    monkeypatch.setattr(files, "cannot_create_in", lambda p: "Permission denied")
    assert tool.main(["--render", str(a), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "--out: " in err and "no file can be created in" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "r").exists()
