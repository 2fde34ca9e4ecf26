"""Run config: one typed tree (model, depth, optim, data, parallel, train, logging).

``load_config("tiny", ["train.max_steps=20"])`` reads ``megaloop/configs/tiny.yaml`` (or a path),
applies dotlist overrides and validates every section; errors name the field.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from megaloop.config_utils import (ConfigError, apply_dotlist, from_dict, load_yaml, renamed_paths, require, to_dict,
                                   use_new_names)
from megaloop.data.config import DataConfig
from megaloop.depth.config import DepthConfig
from megaloop.model.config import ModelConfig, with_legacy_defaults

CONFIG_DIR = Path(__file__).parent / "configs"
ARMS_FILE = CONFIG_DIR / "arms.yaml"  # the paper's arms: override sets, not a preset
SCHEDULES = ("wsd", "cosine", "constant")
DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")  # megatron's WSD decay shapes
NONFINITE = ("skip", "abort")
WANDB_MODES = ("disabled", "offline", "online")


@dataclass
class ParallelConfig:
    """Parallel degrees; data parallelism is what is left of the world size."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None  # model chunks per pipeline rank (interleaved 1F1B)
    sequence_parallel: bool = False
    distributed_optimizer: bool = True

    def __post_init__(self) -> None:
        require(self.tp >= 1, "parallel.tp", f"must be >= 1, got {self.tp}")
        require(self.pp >= 1, "parallel.pp", f"must be >= 1, got {self.pp}")
        require(self.vpp is None or self.vpp >= 1, "parallel.vpp", "must be >= 1 or null")
        # With pp=2 the previous and next stage are the same rank, so the interleaved schedule's
        # concurrent same-shape sends (activations one way, gradients the other) can pair wrongly;
        # measured: wrong losses from the third microbatch at pp=2/vpp=2, exact at pp=4/vpp=2.
        # (Megatron-LM long required pp > 2 for interleaving for the same reason.)
        require(self.vpp in (None, 1) or self.pp > 2, "parallel.vpp",
                f"interleaved pipelining (vpp={self.vpp}) needs parallel.pp > 2, got pp={self.pp}")


@dataclass
class OptimConfig:
    """AdamW + LR schedule. ``wsd``: linear warm-up, constant, decay over the final
    ``decay_fraction`` of ``train.max_steps`` (the horizon)."""

    lr: float = 3e-3
    min_lr: float = 0.0
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_grad: float = 1.0
    schedule: str = "wsd"
    warmup_steps: int = 10
    decay_fraction: float = 0.2
    decay_style: str = "linear"  # WSD decay shape: linear | cosine | exponential | minus_sqrt

    def __post_init__(self) -> None:
        require(self.lr > 0, "optim.lr", f"must be > 0, got {self.lr}")
        require(0 <= self.min_lr <= self.lr, "optim.min_lr", "must be in [0, optim.lr]")
        require(self.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
        require(self.clip_grad >= 0, "optim.clip_grad", "must be >= 0 (0 disables clipping)")
        require(self.schedule in SCHEDULES, "optim.schedule", f"one of {SCHEDULES}")
        require(self.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
        require(0 <= self.decay_fraction <= 1, "optim.decay_fraction", "must be in [0, 1]")
        # a typo here failed at the first decay step (megatron's assert), 80 % into the run
        require(self.decay_style in DECAY_STYLES, "optim.decay_style", f"one of {DECAY_STYLES}, got {self.decay_style!r}")
        require(0 <= self.beta1 < 1, "optim.beta1", f"must be in [0, 1), got {self.beta1}")
        require(0 <= self.beta2 < 1, "optim.beta2", f"must be in [0, 1), got {self.beta2}")
        require(self.eps > 0, "optim.eps", f"must be > 0, got {self.eps}")


@dataclass
class TrainConfig:
    """Batch arithmetic, horizon and cadence. ``global_batch_size`` sequences per optimizer step
    = micro_batch_size × microbatches × data-parallel size."""

    global_batch_size: int = 8
    micro_batch_size: int = 2
    max_steps: int = 100  # schedule horizon
    stop_after: int | None = None  # stop after this many steps without changing the schedule
    # train.seed seeds the initial weights, the depth draws, the h^0 noise and (added to
    # data.shuffle_seed) the data order; init_seed, when set, seeds the initial weights alone
    # (same batches and depth draws, another init: the init-draw spread of a run)
    seed: int = 1234
    init_seed: int | None = None
    log_interval: int = 1
    save_interval: int = 50
    keep_checkpoints: int = 2
    eval_interval: int = 0  # 0 = only at the end
    eval_batches: int = 4  # validation covers eval_batches × global_batch_size sequences (MixVal order); 0 = all
    eval_depth: int = 5
    nonfinite: str = "skip"  # skip the update (and count it) or abort
    max_nonfinite: int = 10  # abort after this many consecutive non-finite steps
    peak_tflops: float = 0.0  # device peak for MFU; 0 = per-device default (H100/H200 bf16: 989)
    # a checkpoint (step dir, checkpoints dir or run dir; e.g. one converted from a Hugging Face
    # folder) whose model weights start a fresh run; optimizer, schedule, depth sampler and data
    # order start at step 0 (continued pretraining, fine-tuning). Ignored when the run resumes.
    init_weights: str | None = None

    def __post_init__(self) -> None:
        require(self.micro_batch_size >= 1, "train.micro_batch_size", "must be >= 1")
        require(self.global_batch_size >= self.micro_batch_size, "train.global_batch_size",
                "must be >= train.micro_batch_size")
        require(self.global_batch_size % self.micro_batch_size == 0, "train.global_batch_size",
                f"{self.global_batch_size} is not a multiple of micro_batch_size {self.micro_batch_size}")
        require(self.max_steps >= 1, "train.max_steps", "must be >= 1")
        require(0 <= self.seed < 2 ** 64, "train.seed", f"must be in [0, 2**64), got {self.seed}")
        require(self.init_seed is None or 0 <= self.init_seed < 2 ** 64, "train.init_seed",
                f"must be in [0, 2**64) or null (= train.seed), got {self.init_seed}")
        require(self.peak_tflops >= 0, "train.peak_tflops", f"must be >= 0 (0 = the device's default), got {self.peak_tflops}")
        require(self.stop_after is None or self.stop_after >= 1, "train.stop_after", "must be >= 1 or null")
        require(self.nonfinite in NONFINITE, "train.nonfinite", f"one of {NONFINITE}")
        require(self.save_interval >= 0, "train.save_interval", "must be >= 0")
        require(self.eval_interval >= 0, "train.eval_interval", f"must be >= 0 (0 = only at the end), got {self.eval_interval}")
        require(self.log_interval >= 1, "train.log_interval", f"must be >= 1, got {self.log_interval}")
        require(self.max_nonfinite >= 0, "train.max_nonfinite", f"must be >= 0 (0 = stop at the first), got {self.max_nonfinite}")
        require(self.keep_checkpoints >= 1, "train.keep_checkpoints", "must be >= 1")
        require(self.eval_depth >= 1, "train.eval_depth", "must be >= 1")
        require(self.eval_batches >= 0, "train.eval_batches", "must be >= 0 (0 = the whole validation set)")

    @property
    def weights_seed(self) -> int:
        """Seed of the initial weights: ``init_seed``, else ``seed``."""
        return self.seed if self.init_seed is None else self.init_seed

    def num_microbatches(self, dp: int) -> int:
        per = self.micro_batch_size * dp
        if self.global_batch_size % per:
            raise ConfigError(
                f"train.global_batch_size: {self.global_batch_size} is not divisible by "
                f"micro_batch_size × data-parallel size = {self.micro_batch_size}×{dp}")
        return self.global_batch_size // per


@dataclass
class LoggingConfig:
    wandb: str = "disabled"  # disabled | offline | online
    project: str = "megaloop"
    name: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        require(self.wandb in WANDB_MODES, "logging.wandb", f"one of {WANDB_MODES}")


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    depth: DepthConfig = field(default_factory=DepthConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        self.model.validate_parallel(self.parallel.tp, self.parallel.sequence_parallel)
        require(self.optim.warmup_steps < self.train.max_steps or self.optim.warmup_steps == 0,
                "optim.warmup_steps", f"{self.optim.warmup_steps} must be < train.max_steps "
                f"({self.train.max_steps}), the schedule horizon")
        tokens = self.model.seq_len * self.train.micro_batch_size
        require(not self.model.fp8 or tokens % 16 == 0, "model.fp8",
                f"tokens per microbatch (seq_len {self.model.seq_len} x train.micro_batch_size "
                f"{self.train.micro_batch_size}) must be a multiple of 16 for FP8 GEMMs")
        if self.model.looped and self.depth.kind == "fixed":
            require(self.depth.depth >= 1, "depth.depth", "must be >= 1")

    def check_trainable(self) -> None:
        """Checks that apply to starting training (not to loading an old run's config for evaluation)."""
        t, o = self.train, self.optim
        require(t.stop_after is None or t.stop_after <= t.max_steps, "train.stop_after",
                f"{t.stop_after} is past train.max_steps={t.max_steps}, the schedule horizon (the run would stop "
                "at the horizon); raise train.max_steps or lower train.stop_after")
        decay = max(1, round(o.decay_fraction * t.max_steps)) if o.schedule == "wsd" and o.decay_fraction > 0 else 0
        require(o.warmup_steps + decay <= t.max_steps, "optim.warmup_steps",
                f"{o.warmup_steps} warm-up steps and the WSD decay's {decay} (optim.decay_fraction={o.decay_fraction} "
                f"of train.max_steps={t.max_steps}) overlap: the LR would jump down mid-warm-up; shorten either")
        # an untied model has no recurrence: a sampled or learned depth would only feed the prior noise
        require(self.model.looped or self.depth.kind == "fixed", "depth.kind",
                f"model.arch=untied has no recurrence depth; use depth.kind=fixed (got {self.depth.kind!r})")
        require(self.model.fp8 or self.model.fp8_recipe == "tensorwise", "model.fp8_recipe",  # it was recorded, unused
                f"{self.model.fp8_recipe!r} is FP8's scaling recipe, but model.fp8 is off (null): add model.fp8=hybrid "
                "(or e4m3), or drop the recipe")
        require(self.model.looped or self.depth.depth == 1, "depth.depth",  # it was logged as if it had run
                f"model.arch=untied has no recurrence depth; it runs depth 1 (got {self.depth.depth})")

    def to_dict(self) -> dict:
        return to_dict(self)

    def dump(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


def resolve_config_path(name_or_path: str) -> Path:
    """A YAML path, or a preset's name (``tiny``, ``S``, ...). An existing file wins over a preset of
    the same name; a *directory* never does (a run folder made with ``--run-dir tiny`` took the place
    of the ``tiny`` preset, the default, for every later command started beside it)."""
    p = Path(name_or_path)
    preset = CONFIG_DIR / f"{name_or_path}.yaml"
    if p.is_dir() and p.suffix not in (".yaml", ".yml") and preset.is_file() and preset != ARMS_FILE \
            and os.sep not in name_or_path and name_or_path not in (".", ".."):
        return preset
    if p.suffix in (".yaml", ".yml") or p.exists():
        return p
    q = preset
    if not q.exists() or q == ARMS_FILE:
        known = sorted(x.stem for x in CONFIG_DIR.glob("*.yaml") if x != ARMS_FILE)
        raise ConfigError(f"config {name_or_path!r}: no such file or preset (presets: {', '.join(known)})")
    return q


def paper_arms() -> dict[str, dict]:
    """The paper's experiment arms (``megaloop/configs/arms.yaml``): name -> {about, overrides}."""
    return yaml.safe_load(ARMS_FILE.read_text())["arms"]


def arm_overrides(name: str) -> list[str]:
    """Dotlist overrides of one paper arm (``--arm NAME``); ConfigError naming the arm if unknown."""
    arms = paper_arms()
    if name not in arms:
        raise ConfigError(f"--arm {name!r}: unknown arm; one of {', '.join(arms)} ({ARMS_FILE.name})")
    return list(arms[name]["overrides"])


def load_saved_config(path: str | Path) -> RunConfig:
    """A run's saved ``config.yaml``; model fields it lacks (written before they existed) take what
    such runs trained with (``model.config.with_legacy_defaults``), not today's defaults."""
    data = load_yaml(path, cls=RunConfig)
    if isinstance(data.get("model", {}), dict):
        data["model"] = with_legacy_defaults(data.get("model") or {})
    return from_dict(RunConfig, data)


# model fields every release's saved config.yaml lists (the resolved config, every field), while
# presets and hand-written files name a few: a file's ``model`` section holding all of them is a
# run's saved config (or a copy of one)
SAVED_CONFIG_MARKERS = ("arch", "num_query_groups", "ffn_hidden_size", "num_layers", "vocab_pad_multiple",
                        "state_init", "eval_state_init", "eval_seed", "deq_std", "norm_eps", "transformer_impl")


def legacy_fields(data: dict) -> dict:
    """The model fields a saved config.yaml (:data:`SAVED_CONFIG_MARKERS`) written by an earlier
    release lacks, with what that release trained with (``ModelConfig.LEGACY_DEFAULTS``); {} for
    any other file (a preset or a hand-written config takes today's defaults)."""
    model = data.get("model")
    if not isinstance(model, dict) or not all(k in model for k in SAVED_CONFIG_MARKERS):
        return {}
    return {k: v for k, v in ModelConfig.LEGACY_DEFAULTS.items() if k not in model}


def load_config(name_or_path: str, overrides: list[str] | None = None, arm: str | None = None) -> RunConfig:
    """Preset name or YAML path, then a paper arm's overrides (``arm``), then ``section.key=value``
    overrides -> validated RunConfig."""
    renames = renamed_paths(RunConfig)
    path = resolve_config_path(name_or_path)
    data = load_yaml(path, renames=renames, cls=RunConfig)
    if legacy := legacy_fields(data):  # re-running an older release's config.yaml trains its model
        data["model"] = {**legacy, **data["model"]}
        if os.environ.get("RANK", "0") == "0":
            given = ", ".join(f"model.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in legacy.items())
            print(f"note: {path} is a run's config.yaml from an earlier release (no {', '.join(legacy)}): "
                  f"{given} as that release trained; add them to the file, or override, for today's defaults",
                  file=sys.stderr, flush=True)
    if arm is not None and not str(arm).strip():
        raise ConfigError("--arm: empty name (an unset shell variable?); give an arm of megaloop/configs/arms.yaml")
    dotlist = (arm_overrides(arm) if arm else []) + list(overrides or [])
    depth = data.get("depth") if isinstance(data.get("depth"), dict) else {}
    file_cap = depth.get("cap", DepthConfig.cap)  # what the config file gives (or the field's default)
    apply_dotlist(data, use_new_names(dotlist, renames), cls=RunConfig)
    cfg = from_dict(RunConfig, data)
    _check_cap_override(cfg, file_cap)
    return cfg


def _check_cap_override(cfg: RunConfig, file_cap) -> None:
    """A ``depth.cap`` set by an override (other than the config file's ``file_cap``) below
    ``depth.r_max`` with a learned prior: SPEC §4's learned law draws 1..R_max with its PLN init's tail
    at R_max, so the cap (PLN's and Poisson's) would be ignored, silently. Presets may carry a cap for
    their PLN arms; only an override is refused."""
    d = cfg.depth
    if d.kind == "learned" and d.cap != d.r_max and d.cap != file_cap:
        raise ConfigError(f"depth.cap: {d.cap} is {'below' if d.cap < d.r_max else 'above'} depth.r_max={d.r_max}, "
                          f"but depth.kind=learned draws 1..r_max (its PLN init's tail sits at r_max) and does not "
                          f"use the cap; set depth.r_max to bound the depths")
