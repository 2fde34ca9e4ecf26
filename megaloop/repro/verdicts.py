"""Claim verdicts computed from an experiment's results: holds / opposite / within noise.

A claim's ``expect:`` (experiment file) lists checks; each is a quantity x, measured per seed, and
the side of a threshold the paper puts it on::

    expect:
      - {arm: huginn_b2, metric: extrapolation_pct, op: "<", value: 2}            # x = m(arm)
      - {arm: orthoinj, metric: terminal_ppl, vs: parcae_decay, op: "<"}          # x = 100 (m/m_vs - 1)
      - {arm: learned_h0.1, metric: prior_p5, vs: learned_h0, diff: absolute, op: "<"}  # x = m - m_vs
      - {arm: huginn_b4, metric: native_ppl, vs: huginn_bR, op: within, value: 1}  # |x| < 1
      - {arm: learned_h0.1, metric: prior_mean, op: within, value: 1, center: 5}   # |x - 5| < 1

``value`` defaults to 0 (``within`` needs one). x is computed per seed and paired: an arm and its
``vs`` arm of the same seed share the seed and the data order. Its mean over seeds has a noise
margin: the half-width of the 95 % Student-t interval, t(0.975, n-1)·sd/√n, or the check's
``noise`` (in x's units, default 0) if that is larger; one seed has no spread, so only ``noise``
counts and the verdict says "1 seed".

A check holds when the whole interval is on the claimed side (``>``: mean − value > margin),
is opposite when the whole interval is on the other side, and is within noise otherwise; for
``within``, with d = |mean − center|: holds if d + margin < value, opposite if d − margin > value.
A claim holds when every check holds, is opposite when any check is opposite, and is within noise
otherwise; a check whose metric is missing for some seed makes the claim "not measured".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from megaloop.config_utils import ConfigError, check_keys

OPS = (">", "<", "within")
DIFFS = ("relative", "absolute")
CHECK_KEYS = ("arm", "metric", "vs", "diff", "op", "value", "center", "noise")
HOLDS, OPPOSITE, NOISE, MISSING = "holds", "opposite", "within noise", "not measured"
# t(0.975, df) for df = 1..30; larger df use the normal 1.96
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


def t975(df: int) -> float:
    """Two-sided 95 % Student-t critical value with ``df`` degrees of freedom (df >= 1)."""
    return _T975[df - 1] if df <= len(_T975) else 1.96


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass
class Check:
    """One comparison of a claim (see the module docstring)."""

    arm: str
    metric: str
    op: str
    value: float = 0.0
    vs: str | None = None
    diff: str = "relative"
    center: float = 0.0
    noise: float = 0.0

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ConfigError(f"op: expected one of {', '.join(OPS)}, got {self.op!r}")
        if self.diff not in DIFFS:
            raise ConfigError(f"diff: expected one of {', '.join(DIFFS)}, got {self.diff!r}")
        for name in ("value", "center", "noise"):
            if not _number(getattr(self, name)):
                raise ConfigError(f"{name}: expected a number, got {getattr(self, name)!r}")
        if self.noise < 0:
            raise ConfigError(f"noise: must be >= 0, got {self.noise}")
        if self.op == "within" and self.value <= 0:
            raise ConfigError(f"value: 'within' needs a positive tolerance, got {self.value}")
        if self.diff == "absolute" and self.vs is None:
            raise ConfigError("diff: 'absolute' compares with a `vs:` arm; give one")

    def describe(self) -> str:
        """``x`` in words, e.g. ``terminal_ppl(orthoinj) vs parcae_decay, %``."""
        x = f"{self.metric}({self.arm})"
        if self.vs is not None:
            x = f"100·({x}/{self.metric}({self.vs}) − 1)" if self.diff == "relative" else f"{x} − {self.metric}({self.vs})"
        if self.op == "within":
            return f"|{x} − {self.center:g}| < {self.value:g}" if self.center else f"|{x}| < {self.value:g}"
        return f"{x} {self.op} {self.value:g}"

    def x(self, m: dict, ref: dict | None) -> float | None:
        """x for one seed from the arm's metrics ``m`` and the ``vs`` arm's ``ref``."""
        a = m.get(self.metric)
        if not _number(a):
            return None
        if self.vs is None:
            return float(a)
        b = (ref or {}).get(self.metric)
        if not _number(b):
            return None
        if self.diff == "absolute":
            return float(a) - float(b)
        return 100.0 * (float(a) / float(b) - 1.0) if b != 0 else None


def parse_checks(raw: Any, arms: set[str], metrics: set[str]) -> list[Check]:
    """``expect:`` of one claim (a mapping or a list of mappings) -> checks; ConfigError names the
    entry and field at fault."""
    if raw is None:
        return []
    items = raw if isinstance(raw, list) else [raw]
    out = []
    for i, c in enumerate(items):
        where = f"expect[{i}]"
        if not isinstance(c, dict):
            raise ConfigError(f"{where}: expected a mapping with arm / metric / op")
        check_keys(c, CHECK_KEYS, where)
        missing = [k for k in ("arm", "metric", "op") if k not in c]
        if missing:
            raise ConfigError(f"{where}: missing {', '.join(missing)}")
        for k in ("arm", "vs"):
            if c.get(k) is not None and c[k] not in arms:
                raise ConfigError(f"{where}.{k}: {c[k]!r} is not an arm of this experiment")
        if c["metric"] not in metrics:
            raise ConfigError(f"{where}.metric: unknown metric {c['metric']!r} (known: {', '.join(sorted(metrics))})")
        try:
            out.append(Check(**c))
        except ConfigError as err:
            raise ConfigError(f"{where}.{err}") from None
        except TypeError as err:  # a wrong-typed value the dataclass cannot take
            raise ConfigError(f"{where}: {err}") from None
    return out


def mean_sd(xs: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (None for fewer than 2 values) of ``xs``."""
    n = len(xs)
    mean = sum(xs) / n
    if n < 2:
        return mean, None
    return mean, math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))


def check_verdict(check: Check, by_seed: dict[str, dict[Any, dict]]) -> dict:
    """Verdict of one check. ``by_seed``: arm -> seed -> metrics of that run."""
    mine, ref = by_seed.get(check.arm, {}), by_seed.get(check.vs, {}) if check.vs else {}
    seeds = sorted(mine, key=str) if check.vs is None else sorted(set(mine) & set(ref), key=str)
    xs = [check.x(mine[s], ref.get(s)) for s in seeds]
    out: dict[str, Any] = {"check": check.describe(), "n": len(xs), "mean": None, "sd": None, "margin": None}
    if not xs or any(x is None for x in xs):
        out["verdict"] = MISSING
        return out
    mean, sd = mean_sd([float(x) for x in xs])  # type: ignore[arg-type]
    margin = max(check.noise, t975(len(xs) - 1) * sd / math.sqrt(len(xs)) if sd is not None else 0.0)
    out.update(mean=mean, sd=sd, margin=margin)
    if check.op == "within":
        d = abs(mean - check.center)
        out["distance"] = d  # |mean − center|, what the check bounds
        verdict = HOLDS if d + margin < check.value else OPPOSITE if d - margin > check.value else NOISE
    else:
        sign = 1.0 if check.op == ">" else -1.0
        gap = sign * (mean - check.value)
        verdict = HOLDS if gap > margin else OPPOSITE if -gap > margin else NOISE
    out["verdict"] = verdict
    return out


def claim_verdict(checks: list[Check], by_seed: dict[str, dict[Any, dict]]) -> dict:
    """``{verdict, checks: [check_verdict...], seeds}`` of one claim (verdict None: no ``expect``)."""
    rows = [check_verdict(c, by_seed) for c in checks]
    if not rows:
        return {"verdict": None, "checks": [], "seeds": 0}
    kinds = [r["verdict"] for r in rows]
    if MISSING in kinds:
        verdict = MISSING
    elif OPPOSITE in kinds:
        verdict = OPPOSITE
    elif all(k == HOLDS for k in kinds):
        verdict = HOLDS
    else:
        verdict = NOISE
    return {"verdict": verdict, "checks": rows, "seeds": min(r["n"] for r in rows)}


def verdict_text(v: dict) -> str:
    """One cell, e.g. ``holds (3 seeds)`` / ``within noise (1 seed: no spread)``."""
    if v.get("verdict") is None:
        return "—"
    n = v.get("seeds", 0)
    if v["verdict"] == MISSING:
        return MISSING
    return f"{v['verdict']} ({n} seed{'s' if n != 1 else ''}{': no spread' if n == 1 else ''})"


def check_text(r: dict) -> str:
    """One check's figure, e.g. ``x < 2: mean +0.42 ± 0.3 sd (n=3, margin 0.75) holds``; a ``within``
    check also gives the distance it bounds: ``|x − 5| < 1: mean +4.99, distance 0.01 (n=1, ...)``."""
    if r["mean"] is None:
        return f"{r['check']}: {MISSING}"
    spread = f" ± {r['sd']:.3g} sd" if r["sd"] is not None else ""
    dist = f", distance {r['distance']:.3g}" if r.get("distance") is not None else ""
    return (f"{r['check']}: mean {r['mean']:+.3g}{spread}{dist} (n={r['n']}, margin {r['margin']:.3g}) "
            f"{r['verdict']}")


__all__ = ["Check", "HOLDS", "MISSING", "NOISE", "OPPOSITE", "check_text", "check_verdict", "claim_verdict",
           "mean_sd", "parse_checks", "t975", "verdict_text"]
