"""Report rendering from a results file (megaloop/repro/report.py, tools/reproduce.py --render): the
paper-layout table, claims beside measured figures, missing values, and the three PNGs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megaloop.repro.report import claim_measured, render_markdown, train_summary


def _arm(name: str, label: str, looped: bool, status: str = "done", **metrics) -> dict:
    sweep = [{"depth": d, "native_ppl": metrics.get("native_ppl", 0) + d} for d in (1, 2, 5, 64)] if looped else \
        [{"depth": 5, "native_ppl": metrics.get("native_ppl")}]
    hist = {"step": [1, 2, 3], "mean": [5.0, 5.2, 5.1], "entropy": [1.9, 1.8, 1.7],
            "probs": [[0.1, 0.1, 0.2, 0.2, 0.4]] * 3} if looped else None
    train = {"steps": 3, "tokens": 6144, "train_seconds": 1.5, "final_loss": 5.0, "val_ce": 5.5,
             "curve": {"step": [1, 2, 3], "loss": [7.0, 6.0, 5.0], "val_step": [3], "val_ce": [5.5]}}
    if hist:
        train["prior_history"] = hist
    return {"name": name, "label": label, "looped": looped, "depth_kind": "learned" if looped else "fixed",
            "overrides": ["train.max_steps=3", "model.injection=orthoinj", "logging.progress=false"],
            "status": status, "step": 3, "exit_code": 0, "run_dir": f"/x/{name}", "train": train,
            "metrics": {**metrics, "sweep": sweep}}


RESULTS = {
    "experiment": "injections", "description": "Five injections.", "source": "/a/injections.yaml",
    "scale": "tiny", "config": "tiny", "note": "CPU direction check",
    "settings": {"seed": 1234, "max_steps": 3, "stop_after": None, "global_batch_size": 16, "seq_len": 128,
                 "data_path": "default", "shuffle": True, "shuffle_seed": 1234, "tokens_per_step": 2048},
    "extras": [], "eval": {"depth": 5, "depths": [1, 2, 5, 64], "sharing": True, "data": "default", "max_seqs": 32,
                           "batch_size": 4, "harness": ["megaloop_toy_mc"], "harness_limit": None},
    "claims": [{"id": "C10", "claim": "OrthoInj | beats Parcae-Decay", "paper": "lower val PPL",
                "metrics": ["terminal_ppl", "downstream"], "arms": ["orthoinj"], "relative_to": "parcae_decay"},
               {"id": "C1", "claim": "fixed points", "paper": "> 25 %", "metrics": ["extrapolation_pct"],
                "arms": ["orthoinj"], "relative_to": None}],
    "arms": [
        _arm("orthoinj", "OrthoInj", True, native_ppl=100.0, terminal_ppl=101.0, sharing_penalty_pct=0.5,
             extrapolation_pct=-1.25, train_flops=1.5e12, prior_mean=5.1, prior_p5=0.4, prior_entropy=1.7,
             downstream=0.5),
        _arm("parcae_decay", "Parcae-Decay", True, native_ppl=110.0, terminal_ppl=115.0, sharing_penalty_pct=2.0,
             extrapolation_pct=3.0, train_flops=1.4e12, prior_mean=5.0, prior_p5=0.5, prior_entropy=1.6,
             downstream=0.25),
        _arm("untied12", "Untied-12", False, status="partial", native_ppl=None),
    ],
    "machine": {"cpu": "Test CPU", "cpus": 2, "platform": "Linux", "python": "3.11", "torch": "2.x"},
    "launcher": {"local": "2 arm(s) in parallel x 1 thread(s)"}, "complete": False, "updated": "2026-01-01 00:00:00",
}


def test_markdown_table_and_claims() -> None:
    md = render_markdown(RESULTS)
    lines = md.splitlines()
    head = next(line for line in lines if line.startswith("| arm | native PPL@R"))
    assert head.split(" | ")[1:] == ["native PPL@R", "terminal PPL", "sharing penalty %", "R=64 extrap. %",
                                     "training FLOPs", "prior mean", "p(5)", "prior entropy", "downstream acc |"]
    row = next(line for line in lines if line.startswith("| OrthoInj"))
    assert row == ("| OrthoInj (`orthoinj`) | 100.00 | 101.00 | +0.50 | -1.25 | 1.500e+12 | 5.100 | 0.400 | "
                   "1.700 | 0.500 |")
    unfinished = next(line for line in lines if line.startswith("| Untied-12"))
    assert "[partial]" in unfinished and unfinished.count("—") == 9
    # scale, steps, tokens, machine and the same-seed statement are in the header
    assert "3 steps x 16 x 128 tokens = 6,144 tokens per arm" in md and "Test CPU, 2 logical CPUs" in md
    assert "seed 1234" in md and "incomplete" in md
    # claims: the paper's figure beside the measured one, relative figures in percent; '|' escaped
    c10 = next(line for line in lines if line.startswith("| C10"))
    assert "OrthoInj \\| beats" in c10 and "lower val PPL" in c10
    assert "orthoinj vs parcae_decay: terminal PPL -12.17 %, downstream acc +100.00 %" in c10
    assert "orthoinj: R=64 extrap. % -1.25" in next(line for line in lines if line.startswith("| C1 "))
    assert "`train.max_steps=3 model.injection=orthoinj`" in md  # tool's logging keys not listed
    arms = {a["name"]: a for a in RESULTS["arms"]}
    assert "—" in claim_measured({"metrics": ["native_ppl"], "arms": ["untied12"], "relative_to": "orthoinj"}, arms)


def test_render_cli_writes_report_and_pngs(tool, tmp_path: Path, capsys) -> None:
    src = tmp_path / "results.json"
    src.write_text(json.dumps(RESULTS))
    assert tool.main(["--render", str(src)]) == 0
    for name in ("ppl_vs_depth.png", "prior_evolution.png", "training_curves.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name
    assert (tmp_path / "report.md").read_text() == render_markdown(RESULTS)
    assert "orthoinj" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert tool.main(["--render", str(bad)]) == 2
    assert "--render: cannot read" in capsys.readouterr().err


@pytest.mark.parametrize("content, words", [
    ([1, 2], "expected a JSON object with keys experiment, scale, config, source, updated, complete, settings, "
             "eval, arms, claims, got a JSON array"),
    ({"format": 1, "content": {"sha256": "x"}}, "expected keys missing or of another type: experiment (string), "),
    ({**RESULTS, "settings": None, "arms": {}}, "expected keys missing or of another type: settings (object), "
                                               "arms (array)"),
    # nested fields: each arm, claim and check, eval and settings (a hand-edited or truncated file)
    ({**RESULTS, "arms": [RESULTS["arms"][0], 3, {**RESULTS["arms"][1], "train": None}]},
     "expected fields missing or of another type: arms[1] (object, got number), arms[2].train (object)"),
    ({**RESULTS, "claims": [{**RESULTS["claims"][0], "expect": [{"arm": "orthoinj", "op": ">"}]}, "C2"]},
     "expected fields missing or of another type: claims[0].expect[0].metric (string), claims[1] (object, got string)"),
    ({**RESULTS, "eval": {"depths": [1]}, "settings": {**RESULTS["settings"], "max_steps": "3"}},
     "expected fields missing or of another type: eval.depth (number), settings.max_steps (number)"),
])
def test_render_refuses_what_is_not_a_results_file(tool, tmp_path: Path, capsys, content, words: str) -> None:
    # e.g. a run's data.json, or any other JSON: one line naming the flag and the file, no traceback
    good, bad = tmp_path / "good.json", tmp_path / "data.json"
    good.write_text(json.dumps(RESULTS))
    bad.write_text(json.dumps(content))
    for argv, flag in ((["--render", str(bad)], "--render"),
                       (["--render", str(good), "--merge", str(bad), "--out", str(tmp_path / "m")], "--merge")):
        assert tool.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"megaloop reproduce: error: {flag}: {bad}: not a `megaloop reproduce` results file: ")
        assert words in err and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.json", "good.json"]  # nothing written


def test_render_names_a_field_deeper_than_the_check(tool, tmp_path: Path, capsys) -> None:
    # a training curve cut by hand: the file is named, no traceback, nothing written
    arm = {**RESULTS["arms"][0], "train": {**RESULTS["arms"][0]["train"], "curve": {"step": [1], "loss": [2.0]}}}
    bad = tmp_path / "results.json"
    bad.write_text(json.dumps({**RESULTS, "arms": [arm, *RESULTS["arms"][1:]]}))
    assert tool.main(["--render", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err == (f"megaloop reproduce: error: --render: {bad}: a results file this version cannot read (edited by "
                   f"hand, or written by another version?): KeyError: 'val_step'\n")
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_render_missing_file(tool, tmp_path: Path, capsys) -> None:
    assert tool.main(["--render", str(tmp_path / "none.json")]) == 2
    assert f"megaloop reproduce: error: --render: cannot read {tmp_path / 'none.json'}: " in capsys.readouterr().err


def test_train_summary_dedupes_resumed_steps() -> None:
    rows = [{"step": 1, "loss": 9.0, "model_flops": 2.0, "step_time_s": 1.0},
            {"step": 2, "loss": 8.0, "model_flops": 2.0, "step_time_s": 1.0},
            {"step": 2, "loss": 7.5, "model_flops": 2.0, "step_time_s": 1.0},  # re-logged after a resume
            {"step": 3, "loss": 7.0, "model_flops": 2.0, "step_time_s": 1.0, "val_ce": 6.0,
             "prior_probs": [0.5, 0.25, 0.125, 0.0625, 0.0625], "prior_mean_depth": 1.94, "prior_entropy": 1.3}]
    s = train_summary(rows, 100, looped=True)
    assert s["steps"] == 3 and s["tokens"] == 300 and s["train_flops"] == 6.0
    assert s["flops_source"] == "sum of logged model_flops" and s["val_ce"] == 6.0
    assert s["prior_p5"] == 0.0625 and s["prior_mean"] == 1.94 and s["curve"]["loss"] == [9.0, 7.5, 7.0]
    rows[-1]["model_flops_total"] = 5.5  # the trainer's cumulative count wins
    assert train_summary(rows, 100, looped=True)["train_flops"] == 5.5
    assert "prior_mean" not in train_summary(rows, 100, looped=False)
    assert train_summary(rows, 100, looped=True)["train_seconds"] == 3.0
    # logged every 10 steps: each logged step time stands for its 10 steps
    sparse = [{"step": s, "loss": 1.0, "step_time_s": 0.5} for s in (10, 20, 30)]
    assert train_summary(sparse, 100, looped=False)["train_seconds"] == 15.0


def _seeded(name: str, seed: int, status: str = "done", **metrics) -> dict:
    label = {"orthoinj": "OrthoInj", "parcae_decay": "Parcae-Decay"}[name]
    a = _arm(f"{name}.seed{seed}", label, True, status=status, **metrics)
    return {**a, "group": name, "seed": seed, "lr": 0.002}


def test_seeds_are_averaged_and_claims_get_computed_verdicts(tmp_path: Path, tool, capsys) -> None:
    res = json.loads(json.dumps(RESULTS))
    res["seeds"] = [0, 1, 2]
    res["arms"] = [_seeded("orthoinj", s, native_ppl=p, terminal_ppl=p + 1) for s, p in enumerate((100.0, 102.0, 104.0))]
    res["arms"] += [_seeded("parcae_decay", s, native_ppl=110.0, terminal_ppl=t) for s, t in enumerate((115.0, 116.0, 114.0))]
    res["arms"].append(_seeded("parcae_decay", 3, status="partial", native_ppl=1.0, terminal_ppl=1.0))
    res["claims"][0]["expect"] = [{"arm": "orthoinj", "metric": "terminal_ppl", "vs": "parcae_decay", "op": "<"}]
    res["claims"][1]["expect"] = [{"arm": "orthoinj", "metric": "extrapolation_pct", "op": ">", "value": 25}]
    md = render_markdown(res)
    row = next(line for line in md.splitlines() if line.startswith("| OrthoInj"))
    assert row.startswith("| OrthoInj (`orthoinj`) | 0.002 | 102.00 ± 2.00 | 103.00 ± 2.00 |")
    pd = next(line for line in md.splitlines() if line.startswith("| Parcae-Decay"))
    assert "[partial]" in pd and "110.00 ± 0.00 |" in pd and "115.00 ± 1.00" in pd  # the unfinished seed is left out
    c10 = next(line for line in md.splitlines() if line.startswith("| C10"))
    assert "**holds (3 seeds)**" in c10 and "n=3" in c10  # terminal PPL −10.4 % ± 2 %: the interval is below 0
    c1 = next(line for line in md.splitlines() if line.startswith("| C1 "))
    assert "**not measured**" in c1  # no extrapolation figure in these runs
    assert "mean ± sample sd over the seeds" in md and "| `orthoinj.seed1` | done | 1 | 0.002 |" in md
    # --render --experiment takes the claims of the experiment file as it is now and recomputes verdicts
    src = tmp_path / "results.json"
    src.write_text(json.dumps(res))
    yaml = tmp_path / "inj.yaml"
    yaml.write_text("scales: {tiny: {config: tiny}}\narms:\n  orthoinj: model.injection=orthoinj\n"
                    "  parcae_decay: model.injection=parcae_decay\nclaims:\n"
                    "  - {id: X, claim: c, paper: p, metrics: [terminal_ppl], arms: [orthoinj], relative_to: parcae_decay,\n"
                    "     expect: {arm: orthoinj, metric: terminal_ppl, vs: parcae_decay, op: '>'}}\n")
    assert tool.main(["--render", str(src), "--experiment", str(yaml)]) == 0
    assert "X: opposite (3 seeds)" in capsys.readouterr().out
    saved = json.loads(src.read_text())
    assert [c["id"] for c in saved["claims"]] == ["X"] and saved["verdicts"][0]["verdict"] == "opposite"
