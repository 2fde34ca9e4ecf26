"""tools/bench/parity.py --report: the per-run table and the init-draw spread of runs that differ
only in their initial weights (``--init-seed``)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT


def _parity():
    spec = importlib.util.spec_from_file_location("parity_tool", ROOT / "tools" / "bench" / "parity.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _result(label: str, system: str, init_seed: int, loss: float, r1: float, r5: float, config=None) -> dict:
    rows = [{"rel_change": 0.1, "state_share": 0.3, "rms_h": 1.0, "contraction": 0.2}] * 4
    return {"label": label, "system": system, "steps": 10, "seed": 1234, "init_seed": init_seed,
            "losses": [loss] * 10, "depths": [5] * 10, "depths_evaluated": [1, 5],
            "val_ppl": {"1": r1, "5": r5}, "val_ppl_zero_init": {"1": r1, "5": r5},
            "states": {"per_recurrence": rows, "rms_e": 1.0}, "config": config,
            "reference_commit": None if system == "megaloop" else "abc", "command": f"cmd {label}"}


def test_spread_table_groups_init_draws_only(tmp_path: Path) -> None:
    cfg = {"hidden_size": 128, "injection": "parcae_decay"}
    runs = [_result("m_a", "megaloop", 1234, 3.5, 50.0, 48.0, cfg), _result("m_b", "megaloop", 1, 3.7, 52.0, 49.4, {**cfg, "added_later": False}),
            _result("other", "megaloop", 2, 9.0, 90.0, 80.0, {**cfg, "injection": "orthoinj"}),
            _result("ref_a", "parcae", 1234, 3.6, 53.0, 49.0), _result("ref_b", "parcae", 1, 3.6, 51.0, 48.0)]
    for r in runs:
        (tmp_path / f"{r['label']}.json").write_text(json.dumps(r))
    md = _parity().render(tmp_path).read_text()
    assert "| m_a | megaloop | 10 | 3.500 | 50.00 | 48.00 | 4.00 % |" in md
    spread = md.split("Init-draw spread")[1].split("Commands:")[0]
    # gains 4.00 % and 5.00 %: mean 4.50, sample sd 0.71; loss 3.5/3.7: 3.600 ± 0.141
    assert "| m_a, m_b | megaloop | [1, 1234] | 3.600 ± 0.141 | 51.00 ± 1.41 | 48.70 ± 0.99 | 4.50 ± 0.71 % (4.00–5.00) |" in spread
    assert "ref_a, ref_b | parcae | [1, 1234]" in spread
    assert "other" not in spread  # another model config is not an init draw of the same run
    assert (tmp_path / "parity.png").is_file()


def test_no_spread_table_without_repeated_configs(tmp_path: Path) -> None:
    r = _result("solo", "megaloop", 1234, 3.5, 50.0, 48.0, {"hidden_size": 128})
    (tmp_path / "solo.json").write_text(json.dumps(r))
    assert "Init-draw spread" not in _parity().render(tmp_path).read_text()


def test_welch_equals_hand_computation() -> None:
    # a = [4, 5], b = [6, 7]: means 4.5 / 6.5, sample variances 0.5 each, se = √(0.25 + 0.25),
    # t = −2/√0.5 = −2.828; df = 0.5² / (0.25² + 0.25²) = 2; with 2 df the t CDF is
    # 1/2 + t / (2√(2 + t²)), so p = 2·(1/2 − 2.828 / (2√10)) = 0.1056.
    t, df, p = _parity().welch([4.0, 5.0], [6.0, 7.0])
    assert abs(t + 2 * 2 ** 0.5) < 1e-9 and abs(df - 2.0) < 1e-9
    assert abs(p - (1 - 8 ** 0.5 / 10 ** 0.5)) < 1e-9


def test_vs_reference_table_means_ratio_and_bars(tmp_path: Path) -> None:
    cfg = {"hidden_size": 128}
    runs = [_result("m_a", "megaloop", 1234, 3.50, 50.0, 48.0, cfg), _result("m_b", "megaloop", 1, 3.52, 52.0, 49.4, cfg),
            _result("ref_a", "parcae", 1234, 3.49, 50.0, 45.0), _result("ref_b", "parcae", 1, 3.51, 50.0, 46.0)]
    for r in runs:
        (tmp_path / f"{r['label']}.json").write_text(json.dumps(r))
    md = _parity().render(tmp_path).read_text()
    row = next(line for line in md.splitlines() if line.startswith("| m_a (2) | ref_a, parcae at mean depth 5.00 (2) |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # losses 3.50/3.52 vs 3.49/3.51: Δ +0.010 (bar met); gains 4.00/5.00 % vs 10.00/8.00 %:
    # means 4.50 vs 9.00, ratio 2.00 (bar not met); Welch on the gains: t = −4.5/√(0.25 + 1) = −4.02
    assert cells[2] == "+0.010" and cells[4] == "yes"
    assert cells[5] == "4.50 % vs 9.00 %" and cells[6] == "2.00" and cells[8] == "no"
    assert cells[7].startswith("t = -4.02, df = ")


def test_spread_keeps_a_new_definition_apart_from_the_old(tmp_path: Path) -> None:
    """A result made before ``qk_norm_gain`` existed (key absent) groups with ``qk_norm_gain=true``
    (the old behaviour), not with ``false``; another depth law (other depth draws) is another group,
    even where the model config reads the same."""
    cfg = {"hidden_size": 128, "qk_norm": True}
    runs = [_result("old_a", "megaloop", 1234, 3.5, 50.0, 48.0, cfg),
            _result("old_b", "megaloop", 1, 3.5, 50.0, 48.0, {**cfg, "qk_norm_gain": True}),
            _result("new_a", "megaloop", 1234, 3.6, 50.0, 47.0, {**cfg, "qk_norm_gain": False}),
            _result("new_b", "megaloop", 1, 3.6, 50.0, 47.0, {**cfg, "qk_norm_gain": False}),
            {**_result("law_a", "megaloop", 1234, 3.7, 50.0, 46.0, cfg), "depths": [4] * 10},
            {**_result("law_b", "megaloop", 1, 3.7, 50.0, 46.0, cfg), "depths": [4] * 10}]
    for r in runs:
        (tmp_path / f"{r['label']}.json").write_text(json.dumps(r))
    spread = _parity().render(tmp_path).read_text().split("Init-draw spread")[1].split("Commands:")[0]
    for group in ("| old_a, old_b |", "| new_a, new_b |", "| law_a, law_b |"):
        assert group in spread, group


def test_repeated_init_seed_is_reported_not_spread(tmp_path: Path, capsys) -> None:
    cfg = {"hidden_size": 128}
    for r in (_result("run", "megaloop", 1234, 3.5, 50.0, 48.0, cfg), _result("rerun", "megaloop", 1234, 3.5, 50.0, 48.0, cfg)):
        (tmp_path / f"{r['label']}.json").write_text(json.dumps(r))
    assert "Init-draw spread" not in _parity().render(tmp_path).read_text()
    assert "no init-draw spread for rerun, run" in capsys.readouterr().err


def test_reference_mean_recurrence_matches_the_training_mean_depth() -> None:
    """Huginn's sampler draws Poisson(λ) + 1 with E[λ] = mean_recurrence: matched passes one less."""
    import argparse

    import pytest

    mod = _parity()

    def ns(system: str, mean: float, law: str = "matched") -> argparse.Namespace:
        return argparse.Namespace(system=system, mean_depth=mean, huginn_mean=law)

    assert mod.reference_mean_recurrence(ns("huginn", 5.0)) == 4
    assert mod.reference_mean_recurrence(ns("huginn", 5.0, "native")) == 5
    assert mod.reference_mean_recurrence(ns("parcae", 5.0)) == 5
    with pytest.raises(SystemExit, match="--mean-depth: the references take an integer"):
        mod.reference_mean_recurrence(ns("parcae", 5.5))
    with pytest.raises(SystemExit, match="--mean-depth: Huginn's sampler has E\\[R\\] >= 2"):
        mod.reference_mean_recurrence(ns("huginn", 1.0))


def test_window_table_averages_each_group_over_windows_and_draws(tmp_path: Path) -> None:
    """Two groups over 16 steps, 8 windows of 2 steps: each cell is the mean over the window's steps
    and the group's draws (here the draws differ by a constant, so the mean is exact by hand)."""
    cfg = {"hidden_size": 128}
    runs = []
    for label, system, init, offset in (("m_a", "megaloop", 1234, 0.0), ("m_b", "megaloop", 1, 0.2),
                                        ("ref_a", "parcae", 1234, 1.0), ("ref_b", "parcae", 1, 1.0)):
        r = _result(label, system, init, 3.5, 50.0, 48.0, None if system != "megaloop" else cfg)
        r.update(steps=16, losses=[float(i) + offset for i in range(16)], depths=[5] * 16)
        runs.append(r)
    for r in runs:
        (tmp_path / f"{r['label']}.json").write_text(json.dumps(r))
    md = _parity().render(tmp_path).read_text()
    table = md.split("Training loss per 2-step window")[1].split("Commands:")[0]
    assert "| steps | m_a (2) | ref_a (2) |" in table
    # window 3 = steps 5–6 = losses 4, 5: m_a 4.5, m_b 4.7 -> 4.600; ref 5.5
    assert "| 5–6 | 4.600 | 5.500 |" in table and "| 15–16 | 14.600 | 15.500 |" in table
    assert table.count("\n| ") == 1 + 8  # the header and one row per window (after the separator)


def test_report_tables_the_copying_probe_of_results_that_have_it(tmp_path: Path) -> None:
    probe = {d: {"loss_first": 11.0, "loss_repeat": 11.0 - g, "copy_gain": g} for d, g in (("1", 0.5), ("5", 2.25))}
    runs = [{**_result("with", "megaloop", 1234, 3.5, 50.0, 48.0), "copying": probe},
            _result("without", "megaloop", 1, 3.6, 50.0, 48.0)]
    for r in runs:
        (tmp_path / f"{r['label']}.json").write_text(json.dumps(r))
    table = _parity().render(tmp_path).read_text().split("In-context copying")[1].split("Commands:")[0]
    assert "| with | megaloop | 10 | 3.500 | 11.00 → 10.50 (**0.50**) | 11.00 → 8.75 (**2.25**) |" in table
    assert "without" not in table


def test_runs_of_other_depths_get_their_own_columns(tmp_path: Path) -> None:
    """The header was the first run's --depths: a run of other depths put its values under wrong columns
    (or raised KeyError)."""
    a = _result("a", "megaloop", 1234, 3.5, 50.0, 48.0)
    b = {**_result("b", "megaloop", 1, 3.6, 40.0, 39.0), "depths_evaluated": [1, 3, 5],
         "val_ppl": {"1": 40.0, "3": 39.5, "5": 39.0}}
    c = {**_result("c", "megaloop", 2, 3.7, 45.0, 44.0), "depths_evaluated": [2], "val_ppl": {"2": 44.0}}
    for r in (a, b, c):
        (tmp_path / f"{r['label']}.json").write_text(json.dumps(r))
    md = _parity().render(tmp_path).read_text()
    assert "| run | system | steps | train loss (mean last 10) | val PPL R=1 | val PPL R=2 | val PPL R=3 | val PPL R=5 |" in md
    assert "| a | megaloop | 10 | 3.500 | 50.00 | – | – | 48.00 | 4.00 % |" in md
    assert "| b | megaloop | 10 | 3.600 | 40.00 | – | 39.50 | 39.00 | 2.50 % |" in md
    assert "| c | megaloop | 10 | 3.700 | – | 44.00 | – | – | nan % |" in md


def test_the_report_without_scipy_is_one_line(monkeypatch) -> None:
    """scipy is in the [eval] extra only: --report on init-draw groups was an ImportError traceback."""
    monkeypatch.setitem(sys.modules, "scipy", None)
    with pytest.raises(SystemExit, match=r"--report: the Welch tests .* need scipy"):
        _parity().welch([4.0, 5.0], [6.0, 7.0])
