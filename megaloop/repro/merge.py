"""Merge the ``results.json`` of one experiment run at different seeds into one result.

Seeds of an experiment may run as separate invocations (another day, another machine, a slurm
array that finished in parts): ``megaloop reproduce --render A/results.json --merge B/results.json
--out DIR`` writes ``DIR/results.json`` (and the report) holding every run of both, so the cells
become mean ± sd over all seeds and the verdicts use the whole spread.

The files must be the same experiment at the same scale, preset, budget, data and evaluation plan
(``settings`` other than the seed, and ``eval``, equal; every run that recorded the content
fingerprint of its training data, ``data.json``, the same one), and each arm must resolve to the same
run config in every file apart from ``train.seed`` and ``logging.*``: the preset with the arm's
overrides applied, so two launchers that spell one config differently (an arm's overrides listed
once or twice, an old field name, a default written out) still merge. A run of a file without a
seed list counts as the run at that file's ``settings.seed``; every run is named
``<arm>.seed<N>``; a seed of an arm found in two files is an error (never silently one of them).
The claims (and their checks) are the first file's; ``--experiment`` replaces them as for
``--render``. Run directories are kept as paths relative to the merged result's folder.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from megaloop.errors import UserError

__all__ = ["merge_results"]

_FREE_OVERRIDES = ("train.seed=", "logging.")  # may differ between the files of one experiment
_FREE_SETTINGS = ("seed", "seeds")


def _fixed(overrides: list[str]) -> list[str]:
    return [o for o in overrides if not o.startswith(_FREE_OVERRIDES)]


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def revision_of(run: dict, results: dict) -> int:
    """The model-defaults revision a run was made under: its own, its file's, else 1 (files
    written before revisions were recorded)."""
    return int(run.get("defaults_revision") or results.get("defaults_revision") or 1)


def _resolved(config: str, overrides: list[str], where: Path, arm: str, revision: int) -> dict[str, Any]:
    """The run config an arm's overrides give on ``config`` (a preset name or path) under the model
    defaults of ``revision`` (``ModelConfig.PREVIOUS_DEFAULTS``: what the code then used where the
    preset and the arm's overrides set nothing), flattened to dotted keys, without the fields that
    may differ between the files (seed, logging)."""
    from megaloop.config import load_config, resolve_config_path
    from megaloop.config_utils import ConfigError, load_yaml, to_dict
    from megaloop.model.config import ModelConfig, as_override

    then: list[str] = []
    if revision < ModelConfig.DEFAULTS_REVISION:
        try:
            preset = load_yaml(resolve_config_path(config)).get("model") or {}
        except ConfigError:
            preset = {}  # load_config below names the problem
        then = [as_override(k, v) for k, v in ModelConfig.PREVIOUS_DEFAULTS.get(revision, {}).items()
                if k not in preset]
    try:
        cfg = _flat(to_dict(load_config(config, then + _fixed(overrides))))
    except ConfigError as e:
        raise UserError(f"--merge: {where}: arm {arm!r} does not resolve on config {config!r}: {e}") from None
    # an untied model runs depth 1 whatever depth.depth says (the committed untied arms set 5; now 1)
    ignore = {"train.seed"} | ({"depth.depth"} if cfg.get("model.arch") == "untied" else set())
    return {k: v for k, v in cfg.items() if k not in ignore and not k.startswith("logging.")}


def _runs(results: dict, path: Path, out: Path) -> list[dict]:
    """The file's runs, each named ``<arm>.seed<N>`` with its seed and its run directory relative to ``out``."""
    seed0 = results["settings"].get("seed")
    runs = []
    for a in results["arms"]:
        group = a.get("group") or a["name"]
        seed = a.get("seed") if a.get("seed") is not None else seed0
        if seed is None:
            raise UserError(f"--merge: {path}: run {a['name']!r} has no seed and the file no settings.seed")
        rd = a.get("run_dir")
        if rd is not None and not Path(rd).is_absolute():
            rd = os.path.relpath(path.parent / rd, out)
        runs.append({**a, "group": group, "seed": int(seed), "name": f"{group}.seed{seed}", "run_dir": rd,
                     "defaults_revision": revision_of(a, results)})
    return runs


def _differing(a: dict, b: dict) -> list[str]:
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def merge_results(paths: list[Path], loaded: list[dict], out: Path) -> dict:
    """One results dict from ``loaded`` (the parsed files at ``paths``), for writing into ``out``."""
    if len(paths) < 2:
        raise UserError("--merge: needs at least two results.json files (--render A --merge B ...)")
    out = Path(out).resolve()
    first, p0 = loaded[0], paths[0]
    s0 = {k: v for k, v in first["settings"].items() if k not in _FREE_SETTINGS}
    for res, p in zip(loaded[1:], paths[1:]):
        for key in ("experiment", "scale", "config"):
            if res.get(key) != first.get(key):
                raise UserError(f"--merge: {p} is {key} {res.get(key)!r}, {p0} is {first.get(key)!r}: "
                                "only seeds of one experiment merge")
        s1 = {k: v for k, v in res["settings"].items() if k not in _FREE_SETTINGS}
        if diff := _differing(s0, s1):
            raise UserError(f"--merge: {p} differs from {p0} in settings {diff} "
                            f"({[(s0.get(k), s1.get(k)) for k in diff]}): only the seed may differ")
        if diff := _differing(first["eval"], res["eval"]):
            raise UserError(f"--merge: {p} was evaluated with another plan than {p0} (eval {diff})")
    runs: dict[tuple[str, int], dict] = {}
    where: dict[tuple[str, int], Path] = {}  # the file each run came from
    configs: dict[str, tuple[dict[str, Any], Path]] = {}  # arm -> its resolved config, first file
    merged = []
    for res, p in zip(loaded, paths):
        file_runs = _runs(res, Path(p).resolve(), out)
        merged.append(f"{os.path.relpath(Path(p).resolve(), out)} (seeds {sorted({r['seed'] for r in file_runs})})")
        for r in file_runs:
            key = (r["group"], r["seed"])
            if key in runs:
                raise UserError(f"--merge: arm {r['group']!r} at seed {r['seed']} is in both {where[key]} "
                                f"and {p}; drop one of them")
            cfg = _resolved(res["config"], r["overrides"], p, r["group"], r["defaults_revision"])
            known, source = configs.setdefault(r["group"], (cfg, p))
            if diff := _differing(known, cfg):
                raise UserError(f"--merge: arm {r['group']!r} resolves to another config in {p} than in "
                                f"{source}: " + ", ".join(f"{k} {known.get(k)!r} vs {cfg.get(k)!r}" for k in diff))
            runs[key], where[key] = r, Path(p).resolve()
    data = {}  # content fingerprint -> the first run (file, arm, seed) that trained on it
    for key, r in runs.items():
        if r.get("data"):
            data.setdefault(r["data"], (where[key], *key))
    if len(data) > 1:
        raise UserError("--merge: the runs trained on different data (content fingerprints of their "
                        "data.json): " + "; ".join(f"{a!r} seed {s} in {p}: {sha[:12]}"
                                                   for sha, (p, a, s) in data.items())
                        + ": only seeds of one dataset merge")
    seeds = list(dict.fromkeys(s for _, s in runs))  # in file order
    groups = list(dict.fromkeys(g for g, _ in runs))
    arms = [runs[(g, s)] for g in groups for s in seeds if (g, s) in runs]
    screens: dict[str, Any] = {}
    for res, p in zip(loaded, paths):
        for g, sc in (res.get("screens") or {}).items():
            if g in screens and screens[g].get("lr") != sc.get("lr"):
                raise UserError(f"--merge: arm {g!r}: LR screen selected {sc.get('lr')} in {p}, "
                                f"{screens[g].get('lr')} in an earlier file")
            screens.setdefault(g, sc)
    launcher = {**(first.get("launcher") or {}), "merged": ", ".join(merged)}
    return {**first, "settings": {**first["settings"], "seeds": seeds}, "seeds": seeds, "arms": arms,
            "screens": screens, "launcher": launcher, "complete": all(a["status"] == "done" for a in arms),
            "updated": time.strftime("%Y-%m-%d %H:%M:%S")}
