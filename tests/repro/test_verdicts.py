"""Claim verdicts (megaloop/repro/verdicts.py) on synthetic per-seed results: holds / opposite /
within noise, the 95 % Student-t margin over seeds, the noise floor of one seed, 'within'
tolerances, missing metrics, and field-naming errors of bad `expect:` entries."""

from __future__ import annotations

import math

import pytest

from megaloop.config_utils import ConfigError
from megaloop.repro.verdicts import (HOLDS, MISSING, NOISE, OPPOSITE, Check, check_verdict, claim_verdict,
                                     check_text, parse_checks, t975, verdict_text)

ARMS = {"a", "b"}
METRICS = {"native_ppl", "extrapolation_pct", "prior_mean"}


def _runs(values: dict[str, list[float]], metric: str = "native_ppl") -> dict[str, dict]:
    return {arm: {seed: {metric: v} for seed, v in enumerate(vs)} for arm, vs in values.items()}


def test_relative_difference_paired_by_seed_with_t_margin() -> None:
    # a is 2 %, 4 %, 3 % above b per seed: mean 3 %, sd 1, margin t(0.975, 2) * 1 / sqrt(3)
    runs = _runs({"a": [102.0, 104.0, 103.0], "b": [100.0, 100.0, 100.0]})
    r = check_verdict(Check(arm="a", metric="native_ppl", vs="b", op=">"), runs)
    assert r["n"] == 3 and r["mean"] == pytest.approx(3.0) and r["sd"] == pytest.approx(1.0)
    assert r["margin"] == pytest.approx(4.303 / math.sqrt(3)) and r["verdict"] == HOLDS  # 3 > 2.48
    assert check_verdict(Check(arm="a", metric="native_ppl", vs="b", op="<"), runs)["verdict"] == OPPOSITE
    # threshold 1 %: the interval [0.52, 5.48] straddles it -> within noise
    assert check_verdict(Check(arm="a", metric="native_ppl", vs="b", op=">", value=1), runs)["verdict"] == NOISE
    # a noise floor larger than the t margin wins
    r = check_verdict(Check(arm="a", metric="native_ppl", vs="b", op=">", noise=5), runs)
    assert r["margin"] == 5 and r["verdict"] == NOISE


def test_seeds_are_paired_not_pooled() -> None:
    # per seed a - b = +1 % exactly although both vary a lot across seeds: sd of the difference is 0
    runs = _runs({"a": [101.0, 202.0, 303.0], "b": [100.0, 200.0, 300.0]})
    r = check_verdict(Check(arm="a", metric="native_ppl", vs="b", op=">"), runs)
    assert r["mean"] == pytest.approx(1.0) and r["margin"] == pytest.approx(0.0, abs=1e-9) and r["verdict"] == HOLDS


def test_one_seed_uses_only_the_noise_floor() -> None:
    runs = _runs({"a": [1.5]}, "extrapolation_pct")
    r = check_verdict(Check(arm="a", metric="extrapolation_pct", op="<", value=2), runs)
    assert (r["n"], r["sd"], r["margin"], r["verdict"]) == (1, None, 0.0, HOLDS)
    r = check_verdict(Check(arm="a", metric="extrapolation_pct", op="<", value=2, noise=1), runs)
    assert r["verdict"] == NOISE
    assert verdict_text(claim_verdict([Check(arm="a", metric="extrapolation_pct", op="<", value=2)], runs)) \
        == "holds (1 seed: no spread)"


def test_within_tolerance_and_absolute_differences() -> None:
    runs = _runs({"a": [5.2, 5.4], "b": [5.0, 5.0]}, "prior_mean")
    # |mean - 5| = 0.3, sd 0.1414, margin 12.706 * 0.1414 / sqrt(2) = 1.27
    near = Check(arm="a", metric="prior_mean", op="within", value=2, center=5)
    assert check_verdict(near, runs)["verdict"] == HOLDS  # 0.3 + 1.27 < 2
    assert check_verdict(Check(arm="a", metric="prior_mean", op="within", value=1, center=5), runs)["verdict"] == NOISE
    far = _runs({"a": [9.0, 9.0]}, "prior_mean")
    assert check_verdict(Check(arm="a", metric="prior_mean", op="within", value=1, center=5), far)["verdict"] == OPPOSITE
    diff = check_verdict(Check(arm="a", metric="prior_mean", vs="b", diff="absolute", op=">"), runs)
    assert diff["mean"] == pytest.approx(0.3)
    # the report line names the distance the check bounds, not only the metric's mean (which read as
    # "|prior_mean − 5| < 1: mean +4.99" for a prior mean of 4.99)
    one = check_verdict(Check(arm="a", metric="prior_mean", op="within", value=1, center=5),
                        _runs({"a": [4.99]}, "prior_mean"))
    assert check_text(one) == "|prior_mean(a) − 5| < 1: mean +4.99, distance 0.01 (n=1, margin 0) holds"
    assert "distance" not in check_text(diff)


def test_claim_aggregation_and_missing_metrics() -> None:
    runs = _runs({"a": [110.0, 111.0], "b": [100.0, 101.0]})
    up = Check(arm="a", metric="native_ppl", vs="b", op=">")
    down = Check(arm="a", metric="native_ppl", vs="b", op="<")
    loose = Check(arm="a", metric="native_ppl", vs="b", op=">", value=9.9, noise=1)
    assert claim_verdict([up], runs)["verdict"] == HOLDS
    assert claim_verdict([up, down], runs)["verdict"] == OPPOSITE  # any part contradicted
    assert claim_verdict([up, loose], runs)["verdict"] == NOISE  # one part not resolved
    assert claim_verdict([Check(arm="a", metric="extrapolation_pct", op=">")], runs)["verdict"] == MISSING
    assert claim_verdict([], runs) == {"verdict": None, "checks": [], "seeds": 0}
    assert t975(1) == 12.706 and t975(30) == 2.042 and t975(200) == 1.96


@pytest.mark.parametrize("entry, message", [
    ({"arm": "a", "metric": "native_ppl", "op": ">="}, r"expect\[0\]\.op: expected one of"),
    ({"arm": "z", "metric": "native_ppl", "op": ">"}, r"expect\[0\]\.arm: 'z' is not an arm"),
    ({"arm": "a", "metric": "native_ppl", "op": ">", "vs": "z"}, r"expect\[0\]\.vs: 'z'"),
    ({"arm": "a", "metric": "ppl", "op": ">"}, r"expect\[0\]\.metric: unknown metric 'ppl'"),
    ({"arm": "a", "metric": "native_ppl", "op": "within"}, r"expect\[0\]\.value: 'within' needs"),
    ({"arm": "a", "metric": "native_ppl", "op": ">", "noise": -1}, r"expect\[0\]\.noise: must be >= 0"),
    ({"arm": "a", "metric": "native_ppl", "op": ">", "diff": "absolute"}, r"expect\[0\]\.diff: 'absolute'"),
    ({"arm": "a", "metric": "native_ppl", "op": ">", "value": "x"}, r"expect\[0\]\.value: expected a number"),
    ({"arm": "a", "metric": "native_ppl"}, r"expect\[0\]: missing op"),
    ({"arm": "a", "metric": "native_ppl", "op": ">", "sign": 1}, r"expect\[0\]: unknown key\(s\) sign"),
])
def test_bad_checks_name_the_field(entry: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_checks([entry], ARMS, METRICS)
