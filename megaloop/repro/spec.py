"""Experiment files: a YAML of arms (name -> config overrides), scales and an evaluation plan.

Schema (every key but ``arms`` optional; unknown keys are errors)::

    name: tbptt                         # default: the file's stem
    description: "..."
    common: "depth.kind=fixed depth.depth=5"   # overrides of every arm (string or list)
    scales:                             # default: tiny/S/M/L -> the preset of that name
      tiny: {config: tiny, overrides: "train.max_steps=300", note: "budget ...", eval: {max_seqs: 32}}
      S: {config: S}
    eval: {depth: 5, depths: [1, 2, 4, 5, 8, 16, 32, 64], sharing: true, harness: [megaloop_toy_mc]}
    arms:                               # mapping (duplicate names are errors) or a list of {name: ...}
      b2_huginn: "model.injection=huginn_linear model.bptt_window=2"
      b4_huginn: {label: "b=4, Huginn-Linear", arm: fixed5_b4, overrides: [...], scales: {tiny: "..."}}
    claims:                             # SPEC §12 rows printed beside the measured figure
      - {id: C2, claim: "...", paper: "<= 2 % ...", metrics: [extrapolation_pct], arms: [b2_huginn],
         expect: [{arm: b2_huginn, metric: extrapolation_pct, op: "<", value: 2}]}  # the computed verdict
      - {id: C9, ..., metrics: [native_ppl], arms: [looped], relative_to: untied12}
    seeds: [0, 1, 2]                    # each arm once per training seed; mean ± sd
    lr: screen                          # every arm's LR: a number, `screen`, or {same_as: ARM}
    scales: {tiny: {screen: {range: [1e-3, 8e-3], points: 4, stop_after: 150}}}   # the screens' grid

``seeds`` (default: one run per arm at the config's ``train.seed``, named by the arm) runs every
arm as ``<arm>.seed<N>`` with ``train.seed=N``: the initial weights, the depth draws and the data
order (the loader shuffles with ``data.shuffle_seed + train.seed``) all change with the seed, as a
seed does in Megatron-LM; the arms of one seed share all three. ``lr: screen`` (top level, or an arm's ``lr:``) screens that arm's learning rate first, as
SPEC §11 / the paper's Appendix B.1: the scale's grid (``screen:``; default the LR-screen tool's
range, points and stop of that scale), each point the arm's own config with its full
``train.max_steps`` WSD horizon, stopped after ``stop_after`` updates, selected by validation CE at
R=``eval_depth`` (5) on the frozen screen set (``screen_set``; default the embedded corpus's
``default:screen``), interior checked; the arm then trains at the selected rate (once per seed).
``{same_as: ARM}`` reuses a screened arm's rate (variants that change only lambda_H or the draw
correlation); a number fixes it. Claim verdicts: ``megaloop/repro/verdicts.py``.

``arm:`` names a paper arm of megaloop/configs/arms.yaml (the one definition of each paper arm,
also ``megaloop train --arm NAME``); an experiment arm adds only what that file does not define
(an injection, a bptt_window). An arm's overrides are applied in the order: the paper arm's, the
scale's, ``common``, the arm's, the arm's per-scale ones, the command line's extras; then the
tool's own (``train.eval_depth``, logging). Seeds, data
and the step/batch budget are the experiment's, never an arm's (same seed and data order for all
arms): arm overrides of ``train.seed``, ``train.max_steps``, ``train.global_batch_size`` or
``data.*`` are rejected. Every arm is validated with ``megaloop.config.load_config`` before
anything runs; errors are ``SpecError`` (a ``UserError``: exit status 2) naming file and arm.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megaloop.config_utils import ConfigError, check_keys, yaml_error_text
from megaloop.errors import UserError
from megaloop.repro.eval_plan import EvalPlan
from megaloop.repro.screens import ScreenPlan, as_rate, screen_plan
from megaloop.repro.verdicts import parse_checks

EXPERIMENTS_DIR = Path(__file__).resolve().parent / "experiments"
ARM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,79}$")  # used as the arm's run-directory name
DEFAULT_SCALES = ("tiny", "S", "M", "L")
TOP_KEYS = ("name", "description", "common", "scales", "eval", "arms", "claims", "seeds", "lr")
SCALE_KEYS = ("config", "overrides", "eval", "note", "screen")
ARM_KEYS = ("label", "arm", "overrides", "scales", "lr")
CLAIM_KEYS = ("id", "claim", "paper", "metrics", "arms", "relative_to", "expect")
# fixed across arms: same seed, data order and budget (set them in `common` or a scale instead)
ARM_FORBIDDEN = ("train.seed", "train.max_steps", "train.global_batch_size", "data.")
# keys that do not change what an arm computes (an arm may be resumed with other values)
IDENTITY_IGNORED = ("train.stop_after", "train.save_interval", "train.keep_checkpoints", "logging.")
METRICS = {  # results key -> report column
    "native_ppl": "native PPL@R", "terminal_ppl": "terminal PPL", "per_visit_ppl": "per-visit PPL",
    "sharing_penalty_pct": "sharing penalty %", "extrapolation_pct": "R=64 extrap. %",
    "train_flops": "training FLOPs", "prior_mean": "prior mean", "prior_p5": "p(5)",
    "prior_entropy": "prior entropy", "downstream": "downstream acc", "val_ce": "val CE (trainer)",
    "final_loss": "final loss",
    # the synthetic task (eval.synth): answer accuracy over held-out k >= eval.synth_min_k
    "synth_acc": "synth acc@R", "synth_acc_r1": "synth acc@1",
    "synth_extrap_pts": "synth acc R_max − R (pts)",
}


class SpecError(UserError):
    """An experiment file is invalid; the message names the file (and the arm)."""


# ----------------------------------------------------------------------------- YAML
class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate mapping keys (YAML would keep the last silently)."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise SpecError(f"duplicate key {key!r} (lines {seen[key] + 1} and {key_node.start_mark.line + 1})")
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _overrides(value: Any, where: str) -> list[str]:
    """A string (shell-split) or a list of ``key=value`` strings -> list; checks the shape."""
    if value is None:
        return []
    if isinstance(value, str):
        items = shlex.split(value)
    elif isinstance(value, list) and all(isinstance(v, str) for v in value):
        items = list(value)
    else:
        raise SpecError(f"{where}: overrides must be a string or a list of key=value strings, got {value!r}")
    for ov in items:
        key = ov.split("=", 1)[0]
        if "=" not in ov or "." not in key or not key.strip():
            raise SpecError(f"{where}: override {ov!r} is not section.key=value")
    return items


def _known_keys(ov: list[str], where: str) -> None:
    """SpecError naming ``where`` for an override key that is no config field."""
    from megaloop.config import RunConfig
    from megaloop.config_utils import _field_type

    for key in _keys(ov):
        if _field_type(RunConfig, key.split(".")) is None:
            raise SpecError(f"{where}: {key}: unknown field (see megaloop/config.py)")


def _keys(ov: list[str]) -> list[str]:
    return [x.split("=", 1)[0].strip() for x in ov]


def identity_overrides(overrides: list[str]) -> list[str]:
    """The overrides that define what an arm computes (run-control keys dropped)."""
    return [o for o, k in zip(overrides, _keys(overrides)) if not k.startswith(IDENTITY_IGNORED)]


# ----------------------------------------------------------------------------- plan pieces
def eval_plan(base: dict | None, update: dict | None, where: str) -> EvalPlan:
    merged = {**(base or {}), **(update or {})}
    unknown = sorted(set(merged) - set(EvalPlan.__dataclass_fields__))
    if unknown:
        raise SpecError(f"{where}: unknown eval key(s) {', '.join(unknown)} "
                        f"(known: {', '.join(EvalPlan.__dataclass_fields__)})")
    try:
        return EvalPlan(**merged)
    except ConfigError as err:
        raise SpecError(f"{where}: {err}") from None


@dataclass
class Claim:
    """A SPEC §12 row: the paper's figure beside the measured ``metrics`` of ``arms`` (with
    ``relative_to``: the percentage 100·(m(arm)/m(ref) − 1))."""

    id: str
    claim: str
    paper: str
    metrics: list[str]
    arms: list[str]
    relative_to: str | None = None
    expect: list[dict] = field(default_factory=list)  # checks of the computed verdict (verdicts.py)


@dataclass
class Arm:
    """One run of the experiment: an arm of the file at one seed (``group``: the file's arm)."""

    name: str
    label: str
    overrides: list[str]  # the complete list passed to `megaloop train` (tool's keys last)
    looped: bool = True
    depth_kind: str = "fixed"
    paper_arm: str | None = None  # the arms.yaml arm its overrides start with
    group: str | None = None  # the experiment file's arm (None: ``name``)
    seed: int | None = None  # train.seed of this run (None: the config's, no seed list)
    lr: str | None = None  # "screen" | "same_as:<arm>" | None (the overrides fix it)

    @property
    def arm(self) -> str:
        return self.group or self.name

    @property
    def lr_source(self) -> str | None:
        """The file arm whose LR screen sets this run's rate (itself for ``lr: screen``), or None."""
        if self.lr == "screen":
            return self.arm
        return self.lr.split(":", 1)[1] if self.lr else None


@dataclass
class Plan:
    """One experiment resolved at one scale: what the runner trains and the report renders."""

    experiment: str
    description: str
    source: str
    scale: str
    config: str
    note: str
    arms: list[Arm]
    eval: EvalPlan
    claims: list[Claim]
    extras: list[str]
    settings: dict  # seed, steps, batch, seq_len, ... (identical across arms, checked)
    seeds: list[int] | None = None  # None: one run per arm at the config's seed
    screen: ScreenPlan | None = None  # set when some arm screens its LR

    def groups(self) -> list[str]:
        """The experiment file's arms, in order (each has one run per seed)."""
        return list(dict.fromkeys(a.arm for a in self.arms))

    def runs_of(self, group: str) -> list[Arm]:
        return [a for a in self.arms if a.arm == group]

    def arm(self, name: str) -> Arm:
        for a in self.arms:
            if a.name == name:
                return a
        raise KeyError(name)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["eval_digest"] = self.eval.digest()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        screen = d.get("screen")
        return cls(experiment=d["experiment"], description=d["description"], source=d["source"],
                   scale=d["scale"], config=d["config"], note=d["note"],
                   arms=[Arm(**a) for a in d["arms"]], eval=EvalPlan(**d["eval"]),
                   claims=[Claim(**c) for c in d["claims"]], extras=list(d["extras"]), settings=d["settings"],
                   seeds=d.get("seeds"), screen=ScreenPlan(**screen) if screen else None)


# ----------------------------------------------------------------------------- loading
def experiment_path(name_or_path: str) -> Path:
    """A shipped experiment name (``tbptt``) or a YAML path."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        if not p.is_file():
            raise SpecError(f"--experiment: {p} is a directory, not an experiment YAML" if p.is_dir()
                            else f"--experiment: {p} does not exist")
        return p
    q = EXPERIMENTS_DIR / f"{name_or_path}.yaml"
    if not q.is_file():
        known = ", ".join(shipped_experiments())
        raise SpecError(f"--experiment: no experiment {name_or_path!r} (shipped: {known}; or a YAML path)")
    return q


def shipped_experiments() -> list[str]:
    return sorted(p.stem for p in EXPERIMENTS_DIR.glob("*.yaml"))


def read_experiment(path: Path) -> dict:
    try:
        data = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except SpecError as err:
        raise SpecError(f"{path}: {err}") from None
    except yaml.YAMLError as err:
        raise SpecError(f"{path}: {yaml_error_text(err)}") from None
    except UnicodeDecodeError as err:
        raise SpecError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except OSError as err:
        raise SpecError(f"{path}: cannot read ({err.strerror})") from None
    if not isinstance(data, dict):
        raise SpecError(f"{path}: expected a mapping with an `arms:` section")
    check_keys(data, TOP_KEYS, path, SpecError)
    return data


def _raw_arms(data: dict, path: Path) -> list[tuple[str, Any]]:
    arms = data.get("arms")
    if arms is None or arms == {} or arms == []:
        raise SpecError(f"{path}: arms: no arms defined (give `arms:` a mapping of name -> overrides)")
    if isinstance(arms, dict):
        items = list(arms.items())
    elif isinstance(arms, list):
        items = []
        for i, a in enumerate(arms):
            if not isinstance(a, dict) or "name" not in a:
                raise SpecError(f"{path}: arms[{i}]: expected a mapping with a `name:`")
            rest = {k: v for k, v in a.items() if k != "name"}
            items.append((a["name"], rest if rest else None))
    else:
        raise SpecError(f"{path}: arms: expected a mapping of name -> overrides, got {type(arms).__name__}")
    seen: set[str] = set()
    for name, _ in items:
        if not isinstance(name, str) or not ARM_NAME.match(name):
            raise SpecError(f"{path}: arm {name!r}: names are 1-80 characters of letters, digits, '_.+-' "
                            "(they name the run directory)")
        if name in seen:
            raise SpecError(f"{path}: arm {name!r}: duplicate arm name")
        seen.add(name)
    return items


def _paper_arm(name: Any, where: str) -> list[str]:
    """Overrides of a paper arm of megaloop/configs/arms.yaml."""
    from megaloop.config import ARMS_FILE, paper_arms

    arms = paper_arms()
    if name not in arms:
        raise SpecError(f"{where}: arm: {name!r} is not an arm of {ARMS_FILE.name} (one of {', '.join(arms)})")
    return list(arms[name]["overrides"])


_UNSET = object()


def file_scales(data: dict) -> list[str]:
    """The scales an experiment file defines (its ``scales:``, else the default ones)."""
    scales = data.get("scales")
    return list(map(str, scales)) if isinstance(scales, dict) and scales else list(DEFAULT_SCALES)


def _arm_parts(name: str, raw: Any, scale: str, path: Path,
               known_scales: list[str] = ()) -> tuple[str, str | None, list[str], list[str], Any]:
    """(label, paper arm, the paper arm's overrides, the arm's own overrides, its ``lr:`` or
    ``_UNSET``) of one arm; an arm's ``scales:`` may only name ``known_scales`` (the file's)."""
    where = f"{path}: arm {name!r}"
    if raw is None:
        raise SpecError(f"{where}: empty arm (give overrides, or [] for the scale's config unchanged)")
    label, paper, paper_ov, lr = name, None, [], _UNSET
    if isinstance(raw, dict):
        check_keys(raw, ARM_KEYS, where, SpecError)
        if not {"arm", "overrides", "scales", "lr"} & set(raw):
            raise SpecError(f"{where}: empty arm (no `arm:` or `overrides:`)")
        label, paper, lr = str(raw.get("label") or name), raw.get("arm"), raw.get("lr", _UNSET)
        paper_ov = _paper_arm(paper, where) if paper is not None else []
        ov = _overrides(raw.get("overrides"), where)
        per_scale = raw.get("scales") or {}
        if not isinstance(per_scale, dict):
            raise SpecError(f"{where}: scales: expected a mapping of scale -> overrides")
        unknown = [k for k in per_scale if str(k) not in known_scales] if known_scales else []
        if unknown:  # a typo (`tnyi:`) dropped the arm's overrides at every scale, silently
            raise SpecError(f"{where}: scales.{unknown[0]}: not a scale of this file (its scales: "
                            f"{', '.join(known_scales)})")
        for other in per_scale:  # every scale's overrides are checked, not only this run's
            _overrides(per_scale[other], f"{where}: scales.{other}")
        ov += _overrides(per_scale.get(scale), f"{where}: scales.{scale}")
    else:
        ov = _overrides(raw, where)
    bad = [k for k in _keys(paper_ov + ov) if k.startswith(ARM_FORBIDDEN)]
    if bad:
        raise SpecError(f"{where}: {bad[0]} must be the same for every arm (same seed, data order and "
                        "budget); set it in `common:` or the scale's overrides")
    return label, paper, paper_ov, ov, lr


def _lr(value: Any, where: str) -> tuple[str | None, list[str]]:
    """An ``lr:`` value -> (``Arm.lr``, overrides it adds)."""
    if value is None or value is _UNSET:
        return None, []
    if value == "screen":
        return "screen", []
    if isinstance(value, dict) and list(value) == ["same_as"] and isinstance(value["same_as"], str):
        return f"same_as:{value['same_as']}", []
    rate = as_rate(value)
    if rate is not None:
        return None, [f"optim.lr={rate!r}"]
    raise SpecError(f"{where}: lr: expected a positive number, `screen` or {{same_as: ARM}}, got {value!r}")


def check_seeds(value: Any, where: str) -> list[int] | None:
    """A seed list (the file's ``seeds:`` or ``--seeds``): distinct integers >= 0, or None."""
    if value is None:
        return None
    if (not isinstance(value, list) or not value
            or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value)):
        raise SpecError(f"{where}: expected a non-empty list of integers >= 0, got {value!r}")
    if len(set(value)) != len(value):
        raise SpecError(f"{where}: expected distinct seeds: {value!r} repeats a seed")
    return list(value)


def _scale(data: dict, scale: str, path: Path) -> tuple[str, list[str], dict, str, Any]:
    scales = data.get("scales")
    if scales is None:
        scales = {s: {"config": s} for s in DEFAULT_SCALES}
    if not isinstance(scales, dict) or not scales:
        raise SpecError(f"{path}: scales: expected a mapping of scale name -> {{config, overrides, eval}}")
    if scale not in scales:
        raise SpecError(f"--scale: {path} has no scale {scale!r} (it has: {', '.join(map(str, scales))})")
    s = scales[scale] or {}
    where = f"{path}: scales.{scale}"
    if not isinstance(s, dict):
        raise SpecError(f"{where}: expected a mapping with config / overrides / eval / note")
    check_keys(s, SCALE_KEYS, where, SpecError)
    config = s.get("config", scale)
    if not isinstance(config, str):
        raise SpecError(f"{where}: config: expected a preset name or YAML path, got {config!r}")
    ev = s.get("eval") or {}
    if not isinstance(ev, dict):
        raise SpecError(f"{where}: eval: expected a mapping")
    return config, _overrides(s.get("overrides"), where), ev, str(s.get("note") or ""), s.get("screen")


def _claims(data: dict, names: set[str], path: Path) -> list[Claim]:
    out = []
    for i, c in enumerate(data.get("claims") or []):
        where = f"{path}: claims[{i}]"
        if not isinstance(c, dict):
            raise SpecError(f"{where}: expected a mapping with id / claim / paper / metrics / arms")
        check_keys(c, CLAIM_KEYS, where, SpecError)
        missing = [k for k in ("id", "claim", "paper", "metrics", "arms") if k not in c]
        if missing:
            raise SpecError(f"{where}: missing {', '.join(missing)}")
        metrics = c["metrics"] if isinstance(c["metrics"], list) else [c["metrics"]]
        arms = c["arms"] if isinstance(c["arms"], list) else [c["arms"]]
        for m in metrics:
            if m not in METRICS:
                raise SpecError(f"{where}: unknown metric {m!r} (known: {', '.join(METRICS)})")
        for a in arms + ([c["relative_to"]] if c.get("relative_to") else []):
            if a not in names:
                raise SpecError(f"{where}: arm {a!r} is not an arm of this experiment")
        try:
            checks = parse_checks(c.get("expect"), names, set(METRICS))
        except ConfigError as err:
            raise SpecError(f"{where}: {err}") from None
        out.append(Claim(id=str(c["id"]), claim=str(c["claim"]), paper=str(c["paper"]), metrics=metrics,
                         arms=arms, relative_to=c.get("relative_to"),
                         expect=[{k: v for k, v in vars(ch).items()} for ch in checks]))
    return out


def load_plan(experiment: str, scale: str, extras: list[str] | None = None,
              eval_update: dict | None = None, only: list[str] | None = None,
              seeds: list[int] | None = None) -> Plan:
    """Resolve ``experiment`` (shipped name or YAML path) at ``scale``: every arm's overrides are
    validated with ``load_config`` (first error: ``SpecError`` naming the file and arm).
    ``extras``: overrides of every arm (command line); ``eval_update``: eval-plan fields set on
    the command line; ``only``: train/evaluate only these arms (file arms or seeded run names);
    ``seeds``: the command line's seeds (replace the file's ``seeds:``)."""
    from megaloop.config import RunConfig, load_config
    from megaloop.config_utils import renamed_paths

    path = experiment_path(experiment)
    data = read_experiment(path)
    name = str(data.get("name") or path.stem)
    config, scale_ov, scale_eval, note, screen_raw = _scale(data, scale, path)
    common = _overrides(data.get("common"), f"{path}: common")
    for where, ov in ((f"{path}: scales.{scale}.overrides", scale_ov), (f"{path}: common", common)):
        _known_keys(ov, where)  # named where they are, not on the first arm that carries them
    extras = _overrides(list(extras or []), "command-line override")
    seeds = seeds if seeds is not None else check_seeds(data.get("seeds"), f"{path}: seeds")
    if seeds is not None and "train.seed" in _keys(extras):
        raise SpecError(f"command-line override train.seed: {path} runs its own seeds {seeds}; drop the override")
    if data.get("eval") is not None and not isinstance(data["eval"], dict):
        raise SpecError(f"{path}: eval: expected a mapping")
    plan_eval = eval_plan({**(data.get("eval") or {}), **scale_eval}, eval_update, f"{path}: eval")
    raw = _raw_arms(data, path)
    arms, settings, first_cfg = [], None, None
    renames = renamed_paths(RunConfig)

    def load(where: str, overrides: list[str]):
        try:
            cfg = load_config(config, overrides)
            cfg.check_trainable()  # what each run's `megaloop train` refuses: named while planning
            return cfg
        except ConfigError as err:
            raise SpecError(f"{where}: {err}") from None
        except (OSError, ValueError) as err:  # e.g. a preset YAML that does not parse
            raise SpecError(f"{where}: {err}") from None

    for arm_name, arm_raw in raw:
        where = f"{path}: arm {arm_name!r}"
        label, paper, paper_ov, arm_ov, lr_raw = _arm_parts(arm_name, arm_raw, scale, path, file_scales(data))
        own_lr = lr_raw is not _UNSET
        lr, lr_ov = _lr(lr_raw if own_lr else data.get("lr"), where)
        if (lr is not None or lr_ov) and "optim.lr" in _keys(arm_ov + extras):
            raise SpecError(f"{where}: optim.lr is set by `lr:` ({lr_raw if own_lr else data.get('lr')!r}); "
                            "remove the override or the arm's `lr:`")
        clash = sorted({renames.get(k, k) for k in _keys(paper_ov + arm_ov)}  # old field names too (b_max)
                       & {renames.get(k, k) for k in _keys(extras)})
        if clash:  # the last value wins: the arm would lose what makes it that arm, keeping its label
            raise SpecError(f"command-line override {clash[0]}: arm {arm_name!r} of {path} sets it itself "
                            f"(every arm gets the command line's overrides); drop it, or leave that arm out "
                            f"with --arms")
        tool = [f"train.eval_depth={plan_eval.depth}", "logging.progress=false",
                f"logging.name=repro-{name}-{scale}-{arm_name}"]
        full = [*paper_ov, *scale_ov, *common, *arm_ov, *lr_ov, *extras, *tool]
        cfg = load(where, full)
        first_cfg = first_cfg or cfg
        mine = {"seed": cfg.train.seed, "max_steps": cfg.train.max_steps, "stop_after": cfg.train.stop_after,
                "global_batch_size": cfg.train.global_batch_size, "seq_len": cfg.model.seq_len,
                "data_path": cfg.data.path, "shuffle": cfg.data.shuffle, "shuffle_seed": cfg.data.shuffle_seed}
        if settings is None:
            settings = mine
        elif mine != settings:
            diff = ", ".join(f"{k} {settings[k]!r} vs {mine[k]!r}" for k in mine if mine[k] != settings[k])
            raise SpecError(f"{where}: differs from the first arm in {diff}; seeds, data "
                            "and budget must be the same for every arm")
        arm = Arm(name=arm_name, label=label, overrides=full, looped=cfg.model.looped,
                  depth_kind=cfg.depth.kind, paper_arm=paper, lr=lr)
        if seeds is None:
            arms.append(arm)
            continue
        for seed in seeds:
            run = f"{arm_name}.seed{seed}"
            if not ARM_NAME.match(run):
                raise SpecError(f"{where}: run name {run!r} is too long (arm names with seeds: <= 72 characters)")
            arms.append(Arm(**{**vars(arm), "name": run, "group": arm_name, "seed": seed,
                               "overrides": [*full, f"train.seed={seed}"]}))
    names = {a for a, _ in raw}
    runs = [a.name for a in arms]
    clash = sorted({r for r in runs if r in names and seeds is not None} | {r for r in runs if runs.count(r) > 1})
    if clash:
        raise SpecError(f"{path}: arm {clash[0]!r}: the name of a seeded run of another arm; rename the arm")
    screen = None
    screened = {a.arm: a for a in reversed(arms) if a.lr == "screen"}  # file arm -> its first run
    for arm in arms:
        target = arm.lr_source
        if target is not None and target not in screened:
            why = ("does not screen its LR (lr: screen)" if target in names
                   else "is not an arm of this experiment")
            raise SpecError(f"{path}: arm {arm.arm!r}: lr: same_as {target!r} {why}")
    if screened:
        try:
            screen = screen_plan(screen_raw, config, first_cfg)
        except ConfigError as err:
            raise SpecError(f"{path}: scales.{scale}.screen{err}") from None
        for arm in screened.values():  # every grid point of every screen must be a valid config
            for lr in screen.grid:
                load(f"{path}: arm {arm.arm!r}: LR screen point {lr:g}",
                     [*arm.overrides, f"optim.lr={lr!r}", f"train.stop_after={screen.stop_after}"])
    if only:
        for o in only:
            if o not in names and o not in runs:
                raise SpecError(f"--arms: {o!r} is not an arm of {path} (arms: {', '.join(a for a, _ in raw)})")
        keep = set(only)
        for arm in arms:  # an arm that reuses a screened rate needs that arm's screen
            if arm.lr_source and (arm.name in keep or arm.arm in keep):
                keep.add(arm.lr_source)
        arms = [a for a in arms if a.name in keep or a.arm in keep]
    assert settings is not None
    settings["tokens_per_step"] = settings["global_batch_size"] * settings["seq_len"]
    if seeds is not None:
        settings["seeds"] = seeds
    claims = _claims(data, names, path)
    if only:
        groups = {a.arm for a in arms}
        claims = [c for c in claims if set(c.arms + ([c.relative_to] if c.relative_to else [])) <= groups]
    return Plan(experiment=name, description=str(data.get("description") or "").strip(), source=str(path),
                scale=scale, config=config, note=note, arms=arms, eval=plan_eval, claims=claims,
                extras=extras, settings=settings, seeds=seeds, screen=screen)


__all__ = ["Arm", "Claim", "EvalPlan", "METRICS", "Plan", "ScreenPlan", "SpecError", "experiment_path", "identity_overrides",
           "load_plan", "read_experiment", "shipped_experiments"]
