"""DeepSpeed JSON configs for the post-training commands: load, check against the command line, fill.

The command line owns everything the trainer's numerics depend on, so a run under DeepSpeed equals
the single-process run with the same global batch:

* batch sizes — ``train_batch_size`` (global rows per optimizer step), ``train_micro_batch_size_per_gpu``
  (rows per process) and ``gradient_accumulation_steps`` (always 1: one optimizer step per rollout /
  batch). Missing keys are filled; present ones must agree, else :class:`ConfigError` names the key;
* ``gradient_clipping`` — from ``--clip-grad`` (0 = off);
* the optimizer — AdamW built from ``--lr``/``--weight-decay`` and handed to ``deepspeed.initialize``;
  an ``optimizer`` or ``scheduler`` section is rejected rather than silently ignored;
* the precision — the model's own dtype (FP32 by default): an ``fp16`` / ``bf16`` / ``amp`` section that
  is enabled would change the numerics and the saved dtype (``fp16`` even skips steps on its loss
  scaler's overflow), so it is rejected naming the section (``"enabled": false`` is accepted); so are an
  enabled ``torch_autocast``, a ``communication_data_type`` or ``data_types.grad_accum_dtype`` other than
  FP32, ``prescale_gradients``, a ``gradient_predivide_factor`` other than 1 and ``gradient_allreduce_op: sum``;
* ZeRO-Offload of the optimizer or parameters (it needs DeepSpeed's CPU Adam) and ``steps_per_print`` < 1 (a
  division by zero at the first step) are rejected before the model loads.

``zero_optimization.stage`` must be 0–3 (and among the stages the command supports). Shipped configs:
``megaloop/configs/deepspeed/zero{1,2,3}.json`` (``--deepspeed zero2`` names one of them).
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

from megaloop.config_utils import ConfigError

STAGES = (0, 1, 2, 3)
SHIPPED_DIR = Path(__file__).resolve().parents[1] / "configs" / "deepspeed"


def shipped_config(name: str) -> Path:
    """``zero1`` | ``zero2`` | ``zero3`` -> the shipped JSON file."""
    return SHIPPED_DIR / f"{name}.json"


def read_ds_config(spec: str | Path, stages: tuple[int, ...] = STAGES) -> tuple[dict, str]:
    """``(dict, label)`` from a shipped name (``zero2``) or a JSON path; errors name the file (and the
    shipped configs of the ``stages`` the command supports)."""
    path = Path(spec)
    if not path.suffix and shipped_config(str(spec)).is_file():
        path = shipped_config(str(spec))
    if path.is_dir():
        raise ConfigError(f"--deepspeed {spec}: is a directory, not a DeepSpeed JSON config file")
    if not path.is_file():
        shipped = ", ".join(sorted(p.stem for p in SHIPPED_DIR.glob("zero*.json")
                                   if p.stem[4:].isdigit() and int(p.stem[4:]) in stages))
        raise ConfigError(f"--deepspeed: no such file {spec} (or a shipped config: {shipped})")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON (line {err.lineno}: {err.msg})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: a DeepSpeed config is a JSON object")
    return cfg, str(path)


def _agree(cfg: dict, key: str, want, label: str, why: str) -> None:
    if key in cfg and cfg[key] != "auto" and cfg[key] != want:
        raise ConfigError(f"{label}: {key}: {cfg[key]!r} contradicts the command line ({why} -> {want!r})")


def load_ds_config(spec: str | Path, *, global_batch: int, world: int, clip_grad: float | None,
                   stages: tuple[int, ...] = STAGES, batch_flag: str = "--batch-size") -> dict:
    """The checked and filled config for a run of ``world`` processes over ``global_batch`` rows per step.

    ``batch_flag`` names the command-line option(s) the global batch comes from (for messages)."""
    raw, label = read_ds_config(spec, stages)
    _check_top_level_keys(label, raw)
    cfg = copy.deepcopy(raw)
    zero = cfg.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ConfigError(f"{label}: zero_optimization: must be an object, got {zero!r}")
    stage = zero.get("stage", 0)
    if not isinstance(stage, int) or isinstance(stage, bool) or stage not in STAGES:
        raise ConfigError(f"{label}: zero_optimization.stage: {stage!r} is not a ZeRO stage (0, 1, 2 or 3)")
    if stage not in stages:
        raise ConfigError(f"{label}: zero_optimization.stage: {stage} is not supported by this command "
                          f"(supported: {', '.join(map(str, stages))})")
    _check_zero_section(label, zero)
    for section in ("optimizer", "scheduler"):
        if section in cfg:
            raise ConfigError(f"{label}: {section}: set from the command line (--lr, --weight-decay, schedule); "
                              "remove this section")
    for section in ("fp16", "bf16", "bfloat16", "amp"):
        body = cfg.get(section)
        if body is None:
            continue
        if not isinstance(body, dict):
            raise ConfigError(f"{label}: {section}: must be an object, got {body!r}")
        if body.get("enabled", False) not in (False, "false"):  # DeepSpeed: off unless "enabled"
            raise ConfigError(f"{label}: {section}: mixed precision is not supported (the command line owns the "
                              f"numerics: the model trains in its own dtype); remove this section or set "
                              f'"enabled": false')
    if global_batch % world:
        raise ConfigError(f"{batch_flag}: the global batch {global_batch} is not divisible by the {world} processes")
    micro = global_batch // world
    _agree(cfg, "train_batch_size", global_batch, label, batch_flag)
    _agree(cfg, "train_micro_batch_size_per_gpu", micro, label, f"{batch_flag} / {world} processes")
    _agree(cfg, "gradient_accumulation_steps", 1, label, "one optimizer step per batch")
    _agree(cfg, "gradient_clipping", float(clip_grad or 0.0), label, "--clip-grad")
    cfg.update(train_batch_size=global_batch, train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=1,
               gradient_clipping=float(clip_grad or 0.0), zero_allow_untested_optimizer=True)
    cfg.setdefault("steps_per_print", 10**9)
    cfg["zero_optimization"] = {**zero, "stage": stage}
    _check_value_types(label, raw, cfg)
    _check_numerics(label, raw, zero)
    return cfg


# settings that change the numerics (or the gradient's scale) with their no-op values; "auto" / absent: the default
_NUMERIC_DEFAULTS = {"communication_data_type": (None, "fp32", "float32"),
                     "seq_parallel_communication_data_type": (None, "fp32", "float32"),
                     "prescale_gradients": (False,), "gradient_predivide_factor": (1, 1.0),
                     "gradient_allreduce_op": ("mean",)}


def _check_numerics(label: str, cfg: dict, zero: dict) -> None:
    """Refuse, before the model loads, the other keys that would change the numerics (the command line
    owns them; accepted before, they trained in another precision or gradient scale without a word) and
    values that fail only inside ``deepspeed.initialize`` or at the first step."""
    autocast = cfg.get("torch_autocast")
    if isinstance(autocast, dict) and autocast.get("enabled", False) not in (False, "false"):
        raise ConfigError(f"{label}: torch_autocast: mixed precision is not supported (the command line owns the "
                          'numerics: the model trains in its own dtype); remove this section or set "enabled": false')
    for key, fine in _NUMERIC_DEFAULTS.items():
        if key in cfg and cfg[key] != "auto" and cfg[key] not in fine:
            raise ConfigError(f"{label}: {key}: {cfg[key]!r} would change the numerics of the update (the command "
                              f"line owns them; the run equals the single-process one); remove it")
    types = cfg.get("data_types")
    grad_dtype = types.get("grad_accum_dtype") if isinstance(types, dict) else None
    if grad_dtype not in (None, "fp32", "float32"):
        raise ConfigError(f"{label}: data_types.grad_accum_dtype: {grad_dtype!r} would change the numerics of the "
                          "update (gradients accumulate in the model's dtype); remove it")
    spp = cfg.get("steps_per_print", 1)  # its type is checked with the others' (1e9 is taken)
    if isinstance(spp, (int, float)) and not isinstance(spp, bool) and spp < 1:
        raise ConfigError(f"{label}: steps_per_print: must be >= 1 (DeepSpeed divides by it), got {spp!r}")
    for old_key, key in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        why = "the command builds torch's AdamW from --lr/--weight-decay, which ZeRO-Offload does not take"
        if zero.get(old_key):  # DeepSpeed's deprecated spelling of the same (device cpu)
            raise ConfigError(f"{label}: zero_optimization.{old_key}: ZeRO-Offload is not supported ({why}); remove it")
        body = zero.get(key)
        device = body.get("device") if isinstance(body, dict) else None
        if device not in (None, "none"):
            raise ConfigError(f"{label}: zero_optimization.{key}: device {device!r} is not supported ({why}); "
                              'remove it or set "device": "none"')


def _check_zero_section(label: str, zero: dict) -> None:
    """DeepSpeed's own validation of ``zero_optimization`` (unknown keys, wrong types), before the
    model loads: its pydantic error would otherwise come as a traceback from ``deepspeed.initialize``."""
    try:
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    except ImportError:  # DeepSpeed not installed: the engine reports that itself
        return
    try:
        DeepSpeedZeroConfig(**zero)
    except Exception as err:  # noqa: BLE001 - pydantic's ValidationError (its import path varies)
        errors = getattr(err, "errors", None)
        items = errors() if callable(errors) else []
        what = "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}" for e in items) or str(err)
        raise ConfigError(f"{label}: zero_optimization: {what}") from None


# top-level keys DeepSpeed reads only through ``in``/``keys()`` or outside DeepSpeedConfig (documented ones)
_EXTRA_KEYS = ("optimizer", "scheduler", "flops_profiler", "activation_checkpointing", "aio", "autotuning",
               "sequence_parallel_size", "model_info", "zero_optimization", "amp", "fp16", "bf16", "bfloat16",
               "tensorboard", "wandb", "csv_monitor", "comet", "elasticity", "compression_training",
               "data_efficiency", "curriculum_learning", "checkpoint", "nebula", "pipeline", "compile",
               "hybrid_engine", "sparse_attention", "sparse_gradients", "weight_quantization", "tensor_parallel")


# DeepSpeed's modules of config key constants (DeepSpeed 0.19; missing ones are skipped)
_KEY_MODULES = tuple("deepspeed." + m for m in (
    "constants", "autotuning.constants", "checkpoint.constants", "comm.constants", "compile.constants",
    "monitor.config", "profiling.constants", "runtime.constants", "runtime.activation_checkpointing.config",
    "runtime.data_pipeline.constants", "runtime.model_checkpointing.constants", "runtime.swap_tensor.constants",
    "runtime.zero.config", "runtime.zero.offload_config", "elasticity.constants", "compression.constants",
    "nebula.constants", "runtime.precision_config", "runtime.tensor_parallel.config"))


@functools.lru_cache(maxsize=1)
def known_top_level_keys() -> frozenset[str] | None:
    """The top-level keys this DeepSpeed knows: those its ``DeepSpeedConfig`` looks up (recorded on a
    minimal config), the key constants of its config modules, and :data:`_EXTRA_KEYS`. None when
    DeepSpeed is not installed or cannot be asked (then no key is refused)."""
    import importlib

    keys = looked_up_keys()
    if keys is None:
        return None
    keys = set(keys)
    for name in _KEY_MODULES:
        try:
            mod = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - optional parts (or another DeepSpeed version's layout)
            continue
        keys |= {v for k, v in vars(mod).items() if k.isupper() and isinstance(v, str) and v == v.lower()
                 and v.replace("_", "").isalnum()}
    return frozenset(keys | set(_EXTRA_KEYS))


@functools.lru_cache(maxsize=1)
def looked_up_keys() -> frozenset[str] | None:
    """The top-level keys DeepSpeed's ``DeepSpeedConfig`` looks up, recorded on a minimal config (None
    when DeepSpeed is not installed or cannot be asked)."""
    try:
        from deepspeed.runtime.config import DeepSpeedConfig
    except Exception:  # noqa: BLE001 - DeepSpeed absent or broken: the engine reports that itself
        return None
    seen: set = set()

    class Recording(dict):
        def __getitem__(self, k):
            seen.add(k)
            return super().__getitem__(k)

        def get(self, k, default=None):
            seen.add(k)
            return super().get(k, default)

        def __contains__(self, k):
            seen.add(k)
            return super().__contains__(k)

    try:
        import contextlib
        import io

        with contextlib.redirect_stdout(io.StringIO()):
            DeepSpeedConfig(Recording(train_batch_size=1, train_micro_batch_size_per_gpu=1,
                                      gradient_accumulation_steps=1))
    except Exception:  # noqa: BLE001 - a DeepSpeed whose config cannot be built like this: no check
        return None
    return frozenset(k for k in seen if isinstance(k, str))


def _check_top_level_keys(label: str, cfg: dict) -> None:
    """Refuse a top-level key DeepSpeed does not know (a typo is otherwise ignored silently), naming it
    and the closest known key."""
    known = known_top_level_keys()
    if known is None:
        return
    import difflib

    for key in cfg:
        if key not in known:
            near = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.75)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ConfigError(f"{label}: {key}: not a DeepSpeed config key{hint}")


# top-level keys read as numbers whose DeepSpeed default (None) does not tell their type
_NUMBER_KEYS = {"steps_per_print": int}
_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_MINIMAL = dict.fromkeys(_BATCH_KEYS[1:], 1)  # train_batch_size follows from DeepSpeed's own world size


@functools.lru_cache(maxsize=1)
def default_types() -> dict[str, type]:
    """``{top-level key: type}`` from DeepSpeed's own defaults (``KEY = "key"`` with a bool / int / float /
    str ``KEY_DEFAULT`` in its constants modules, for the top-level keys its ``DeepSpeedConfig`` looks
    up), plus :data:`_NUMBER_KEYS`; empty when DeepSpeed cannot be asked."""
    import importlib

    known = looked_up_keys()
    if known is None:
        return {}
    types: dict[str, type] = {}
    for name in _KEY_MODULES:
        try:
            mod = vars(importlib.import_module(name))
        except Exception:  # noqa: BLE001 - optional parts (or another DeepSpeed version's layout)
            continue
        for const, key in mod.items():
            default = mod.get(f"{const}_DEFAULT")
            if (const.isupper() and isinstance(key, str) and key in known and key not in types
                    and type(default) in (bool, int, float, str)):
                types[key] = type(default)
    return {**types, **_NUMBER_KEYS}


def _ds_config_error(cfg: dict) -> str | None:
    """DeepSpeed's own ``DeepSpeedConfig`` on ``cfg`` (one row per process and step: the batch keys are the
    command line's, checked above): None when it accepts it, else the first line of its error
    (pydantic's ``loc: msg``)."""
    import contextlib
    import io

    from deepspeed.runtime.config import DeepSpeedConfig

    try:
        with contextlib.redirect_stdout(io.StringIO()):
            DeepSpeedConfig({**{k: v for k, v in copy.deepcopy(cfg).items() if k not in _BATCH_KEYS}, **_MINIMAL})
    except Exception as err:  # noqa: BLE001 - TypeError, AttributeError, pydantic's ValidationError, ...
        errors = getattr(err, "errors", None)
        items = errors() if callable(errors) else []
        what = "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}" for e in items)
        return what or (str(err).strip().splitlines() or [type(err).__name__])[0]
    return None


def _type_ok(value, want: type) -> bool:
    if want is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if want is int:  # 1e9 reads as a float in JSON; DeepSpeed takes it
        return isinstance(value, int) and not isinstance(value, bool) or isinstance(value, float) and value.is_integer()
    if want is bool:  # 0 / 1 act as false / true where DeepSpeed reads the flag
        return isinstance(value, bool) or type(value) is int and value in (0, 1)
    return isinstance(value, want)


_TYPE_WORDS = {bool: "true or false (a JSON boolean)", int: "an integer", float: "a number", str: "a string"}


def _check_value_types(label: str, raw: dict, cfg: dict) -> None:
    """Refuse a top-level value of the wrong type (``"wall_clock_breakdown": "yes"``), naming the key, before
    the model loads: DeepSpeed's own ``DeepSpeedConfig`` checks the filled config, and a key whose
    DeepSpeed default is a bool / int / float / str must have that type (some are only used, and fail,
    inside ``deepspeed.initialize`` or later in training). Nothing is checked without DeepSpeed."""
    types = default_types()
    if not types or _ds_config_error({}) is not None:  # DeepSpeed absent, or not askable like this
        return
    for key, value in raw.items():
        want = types.get(key)
        if key not in _BATCH_KEYS and want is not None and value != "auto" and not _type_ok(value, want):
            raise ConfigError(f"{label}: {key}: must be {_TYPE_WORDS[want]}, got {value!r}")
    if (whole := _ds_config_error(cfg)) is None:
        return
    for key, value in raw.items():  # name the key DeepSpeed rejects
        if key in _BATCH_KEYS or _ds_config_error({key: value}) is None:
            continue
        if not isinstance(value, dict) and _ds_config_error({key: {}}) is None:
            raise ConfigError(f"{label}: {key}: must be an object, got {value!r}")
        raise ConfigError(f"{label}: {key}: {_ds_config_error({key: value})}")
    raise ConfigError(f"{label}: DeepSpeed rejects this config: {whole}")

