"""tools/plan_validation/ab_compare.py: round pairing, ratios, refusal of mismatched depth draws."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("ab_compare", ROOT / "tools/plan_validation/ab_compare.py")
ab = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ab)


def _result(path: Path, makespans, bubble, depths=((5, 5), (3, 7))) -> str:
    rows = [{"depths": list(d), "measured_makespan_s": m} for d, m in zip(depths, makespans)]
    path.write_text(json.dumps({"time_x": {"mode": "timing", "rows": rows,
                                           "mean": {"measured_bubble": bubble, "sim_cost_model": bubble + 0.01}},
                                "mem_y": {"mode": "memory"}}))
    return str(path)


def test_rounds_pair_and_ratios(tmp_path) -> None:
    a = [_result(tmp_path / "a1.json", [1.0, 1.0], 0.20), _result(tmp_path / "a2.json", [2.0, 2.0], 0.30)]
    b = [_result(tmp_path / "b1.json", [0.5, 1.5], 0.10), _result(tmp_path / "b2.json", [1.0, 1.0], 0.20)]
    r = ab.compare(a, b)["time_x"]
    assert [x["ratio"] for x in r["rounds"]] == [1.0, 0.5]
    assert r["ratio_mean"] == pytest.approx(0.75) and r["ratio_sd"] == pytest.approx(0.3535534, rel=1e-6)
    assert r["bubble_a"] == pytest.approx(0.25) and r["bubble_b"] == pytest.approx(0.15)


def test_different_depth_draws_are_refused(tmp_path) -> None:
    a = [_result(tmp_path / "a.json", [1.0, 1.0], 0.2)]
    b = [_result(tmp_path / "b.json", [1.0, 1.0], 0.2, depths=((5, 5), (4, 7)))]
    with pytest.raises(SystemExit, match="round 1 drew different depths"):
        ab.compare(a, b)
    with pytest.raises(SystemExit, match="same number"):
        ab.compare(a, [])
