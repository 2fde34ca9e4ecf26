"""The learning-rate screens of an experiment (``lr: screen`` arms; SPEC §11, Appendix B.1).

A screened arm first trains one short run per LR of the scale's grid, each its own config with
the full ``train.max_steps`` WSD horizon, stopped after ``stop_after`` updates, evaluated at
R=``eval_depth`` on the frozen screen set; the best finite validation CE selects the rate, which
must be interior to the grid. The runs are points of megaloop/screen (the ``megaloop lr-screen``
tool's run state and selection); megaloop/repro/runs.py puts them on the experiment's sweep.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megaloop.config_utils import ConfigError, check_keys

SCREEN_KEYS = ("range", "grid", "points", "stop_after", "eval_depth", "eval_batches", "screen_set")


@dataclass
class ScreenPlan:
    """The LR screen of every ``lr: screen`` arm (SPEC §11): grid, stop, selection depth and set."""

    grid: list[float]
    stop_after: int
    eval_depth: int = 5
    eval_batches: int | None = None
    screen_set: str = "default:screen"



def as_rate(v: Any) -> float | None:
    """A positive finite learning rate from YAML (PyYAML reads ``1e-3`` as a string), else None."""
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            return None
    if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf"):
        return float(v)
    return None


def _positive_int(v: Any, where: str, *, optional: bool = False) -> int | None:
    if v is None and optional:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ConfigError(f"{where}: expected an integer >= 1, got {v!r}")
    return v


def _check_local_set(path: str, seq_len: int, where: str) -> None:
    """A local screen set is an MDS dataset (manifest.json) whose sequences fit the model, checked
    before anything runs (as ``megaloop lr-screen --screen-set`` does)."""
    import json
    from pathlib import Path

    if "://" in path or path.startswith("default"):
        return
    mf = Path(path) / "manifest.json"
    if not Path(path).is_dir():
        raise ConfigError(f"{where}: {path} is not a directory (expected an MDS dataset, e.g. the screen/ "
                          "directory written by data_prep/build_eval_sets.py)")
    try:
        seq = json.loads(mf.read_text()).get("seq_len")
    except (OSError, ValueError, AttributeError) as err:
        raise ConfigError(f"{where}: {mf} is missing or unreadable ({err}): not a megaloop MDS dataset") from None
    if isinstance(seq, int) and seq > seq_len:
        raise ConfigError(f"{where}: {path} holds {seq}-token sequences, longer than model.seq_len {seq_len}")


def screen_plan(raw: Any, config: str, cfg: Any, where: str = "") -> ScreenPlan:
    """A scale's ``screen:`` settings, defaults from the LR-screen tool's scale (SPEC §11); a
    ConfigError starts with ``.key: `` (appended to where the mapping lives) or ``: ``."""
    from megaloop.screen.core import SCALE_DEFAULTS, log_grid, lr_tag, scale_of

    raw = raw or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping with {' / '.join(SCREEN_KEYS)}")
    check_keys(raw, SCREEN_KEYS, where)
    defaults = SCALE_DEFAULTS.get(scale_of(config) or "", {})

    def lrs(v: Any, key: str) -> list[float]:
        xs = [as_rate(x) for x in v] if isinstance(v, list) else [None]
        if any(x is None for x in xs):
            raise ConfigError(f"{where}.{key}: expected a list of positive learning rates, got {v!r}")
        return xs  # type: ignore[return-value]

    if "grid" in raw:
        if "range" in raw or "points" in raw:
            raise ConfigError(f"{where}.grid: give either grid or range/points, not both")
        given = lrs(raw["grid"], "grid")
        if repeated := sorted({x for x in given if given.count(x) > 1}):  # `lr-screen --grid` refuses these too
            raise ConfigError(f"{where}.grid: learning rate {lr_tag(repeated[0])} is given twice; drop one")
        grid = sorted(given)
    else:
        rng = raw.get("range", defaults.get("range"))
        if rng is None:
            raise ConfigError(f"{where}.range: no default LR range for config {config!r} (defaults exist for "
                            f"{', '.join(SCALE_DEFAULTS)}); give screen: {{range: [lo, hi]}}")
        lo_hi = lrs(list(rng), "range")
        if len(lo_hi) != 2 or lo_hi[0] >= lo_hi[1]:
            raise ConfigError(f"{where}.range: expected [lo, hi] with 0 < lo < hi, got {rng!r}")
        points = _positive_int(raw.get("points", defaults.get("points", 5)), f"{where}.points")
        grid = log_grid(lo_hi[0], lo_hi[1], points)
    tags = [lr_tag(x) for x in grid]  # run folders are named by the rate at 6 significant digits
    if dups := sorted({t for t in tags if tags.count(t) > 1}):
        raise ConfigError(f"{where}.grid: learning rates {dups[0]} coincide at 6 significant digits "
                          "(the runs' folder names); drop one")
    if len(grid) < 3:
        raise ConfigError(f"{where}: the grid {grid} has fewer than 3 points: it cannot bracket an optimum")
    stop = raw.get("stop_after", defaults.get("stop_after"))
    if stop is None:
        raise ConfigError(f"{where}.stop_after: no default for config {config!r}; give the number of updates")
    stop = _positive_int(stop, f"{where}.stop_after")
    if stop > cfg.train.max_steps:
        raise ConfigError(f"{where}.stop_after: {stop} exceeds the horizon train.max_steps={cfg.train.max_steps}; "
                        "a screen run stops inside the full run's schedule")
    screen_set = raw.get("screen_set")
    if screen_set is None:
        if cfg.data.path not in ("default", "default:train"):
            raise ConfigError(f"{where}.screen_set: required for data.path={cfg.data.path} (only the embedded "
                            "default dataset has a known screen set)")
        screen_set = "default:screen"
    if not isinstance(screen_set, str) or not screen_set:
        raise ConfigError(f"{where}.screen_set: expected a dataset path, got {screen_set!r}")
    if cfg.data.val_path and screen_set == cfg.data.val_path:
        raise ConfigError(f"{where}.screen_set: {screen_set} is the main validation set (data.val_path); SPEC §11 "
                        "screens on a distinct frozen set")
    _check_local_set(screen_set, cfg.model.seq_len, f"{where}.screen_set")
    return ScreenPlan(grid=grid, stop_after=stop, screen_set=screen_set,
                      eval_depth=_positive_int(raw.get("eval_depth", 5), f"{where}.eval_depth"),
                      eval_batches=_positive_int(raw.get("eval_batches"), f"{where}.eval_batches", optional=True))


__all__ = ["SCREEN_KEYS", "ScreenPlan", "as_rate", "screen_plan"]
