"""The one model loader: a native checkpoint (any TP/PP layout; step dir, ``RUN/checkpoints`` or
``RUN``) or an exported HF folder (optionally with a distilled-prefill student) →
``MegaloopForCausalLM`` in eval mode, and where it came from::

    model, source = load_model("runs/S/checkpoints", device="cuda", dtype="bf16")

Used by the inference engine (``megaloop eval`` / ``generate``), ``rl`` and ``distill-prefill``. A
checkpoint is gathered into a TP=1/PP=1 FP32 native model here and mapped onto the HF model with
its run's tokenizer ids (:func:`megaloop.hf.convert.to_hf_model`). Validation (default; opt out
with ``validate=False``): the HF model must reproduce the native logits — FP32, eval mode, the
configured depth, 2 random sequences of ``min(seq_len, 64)`` tokens — to ``max|Δ| / max(1,
max|logit|) <= 1e-4``, else ``ConversionError``; one forward of each model (milliseconds for test
models). HF folders load as saved (``megaloop convert`` validated them). ``source`` (JSON-able):
``kind`` (checkpoint | hf), ``path``, ``step``, ``tokenizer`` (tokenizer.json or None), ``validation``.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import NamedTuple, Optional, Union

import torch

from megaloop.config_utils import ConfigError
from megaloop.hf.convert import DTYPES, ConversionError, load_native, to_hf_model
from megaloop.hf.live_read import load_newest
from megaloop.hf.validate import check_conversion
from megaloop.hf.modeling_megaloop import MegaloopForCausalLM


class LoadedModel(NamedTuple):
    """What :func:`load_model` returns: ``model, source = load_model(...)``."""

    model: MegaloopForCausalLM  # eval mode
    source: dict  # kind, path, step, tokenizer, validation


def resolve_dtype(dtype: Union[str, torch.dtype, None]) -> torch.dtype:
    """``fp32`` / ``bf16`` / ``fp16`` (or a torch dtype; None = FP32); ConfigError naming ``--dtype``."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype or torch.float32
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype: unknown dtype {dtype!r}; one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def resolve_device(device: Union[str, torch.device, None]) -> torch.device:
    """``auto`` / None = CUDA when available; ConfigError naming ``--device`` for absent CUDA."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(f"--device {device}: not a device; one of auto, cpu, cuda, cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: CUDA is not available on this machine")
    return dev


def is_hf_folder(path: Union[str, Path]) -> bool:
    """True for an exported HF folder (``config.json`` with ``model_type: megaloop``); a config.json
    that cannot be read as JSON raises :class:`ConversionError` naming it (a damaged HF folder)."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return False
    try:
        data = json.loads(cfg.read_text())
    except (OSError, ValueError) as err:  # JSONDecodeError, UnicodeDecodeError
        raise ConversionError(f"{cfg} is not valid JSON ({err}): a damaged or partial Hugging Face folder") from None
    return isinstance(data, dict) and data.get("model_type") == "megaloop"


def check_model_path(path: Union[str, Path], flag: str = "--model") -> str:
    """``"hf"`` or ``"checkpoint"`` for a loadable model path, else :class:`ConfigError` (one line
    naming ``flag`` and the path): missing, an empty directory, a file, an unreadable config.json, or
    neither kind. Cheap: commands call it before anything is loaded or written."""
    from megaloop.train.checkpoint import CheckpointError, find_checkpoint

    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{flag} {p}: no such file or directory")
    if not p.is_dir():
        raise ConfigError(f"{flag} {p}: is a file, not an HF folder or a megaloop checkpoint")
    if not any(p.iterdir()):
        raise ConfigError(f"{flag} {p}: is an empty directory, not an HF folder or a megaloop checkpoint")
    try:
        hf = is_hf_folder(p)
    except ConversionError as err:
        raise ConfigError(f"{flag} {p}: {err}") from None
    if hf:
        return "hf"
    try:
        find_checkpoint(p)
    except CheckpointError as err:
        raise ConfigError(f"{flag} {p}: neither an HF folder (config.json with model_type \"megaloop\") nor "
                          f"a megaloop checkpoint ({str(err).splitlines()[0]})") from None
    return "checkpoint"


def model_arch(path: Union[str, Path]) -> Optional[str]:
    """The architecture (``looped`` / ``untied``) a checkpoint or HF folder records, read without
    loading weights; None when it cannot be told cheaply (loading then reports what is wrong)."""
    try:
        p = Path(path)
        if is_hf_folder(p):
            cfg = json.loads((p / "config.json").read_text())
            return str(cfg.get("arch") or ("looped" if cfg.get("looped", True) else "untied"))
        from megaloop.hf.convert import read_run_config
        from megaloop.train.checkpoint import find_checkpoint

        return str((read_run_config(find_checkpoint(p)).get("model") or {}).get("arch") or "looped")
    except Exception:  # noqa: BLE001 - a cheap peek only; load_model raises the real error
        return None


def load_model(path: Union[str, Path], *, device="cpu", dtype=torch.float32, num_recurrences: Optional[int] = None,
               validate: bool = True, kind: Optional[str] = None,
               student: Union[str, Path, None] = None, tokenizer: Union[str, Path, None] = None) -> LoadedModel:
    """``(model, source)`` of ``path`` (module docstring). ``kind``: ``checkpoint`` / ``hf`` insists
    on one (None: either); ``num_recurrences``: the default depth (else the run's
    ``train.eval_depth`` / the folder's); ``student``: a distilled-prefill student folder
    (``megaloop distill-prefill --out``) checked against the model's shape, through which every
    prefill then runs (``source["student"]``). CheckpointError for a bad checkpoint (or no HF
    folder where one is expected), ConversionError for a failed validation, ConfigError naming
    ``--student`` for a bad or mismatched student. ``tokenizer`` (``--tokenizer``): a checkpoint's
    tokenizer.json chosen by the user (its vocabulary size and eos/pad ids go into the converted
    config, and the run's own is not searched for); anything that is not a tokenizer.json (a
    SentencePiece model, ``default``, ``bytes``) is left to the caller."""
    dev, dt = resolve_device(device), resolve_dtype(dtype)
    hf = is_hf_folder(path)
    if kind == "hf" and not hf:
        from megaloop.train.checkpoint import CheckpointError

        raise CheckpointError(f"{path} is not a megaloop HF folder (no config.json with model_type 'megaloop')")
    if hf and kind != "checkpoint":
        model, source = _from_hf(Path(path), dt)
    else:
        model, source = _from_checkpoint(path, num_recurrences, validate, json_tokenizer(tokenizer))
    if num_recurrences is not None:
        model.config.num_recurrences = int(num_recurrences)
    model = model.to(device=dev, dtype=dt).eval()
    if student is not None:
        from megaloop.post.distill.student_lm import with_student

        model, source = with_student(model, student).eval(), {**source, "student": str(student)}
    return LoadedModel(model, source)


HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                   "pytorch_model.bin.index.json")


def _from_hf(path: Path, dtype: torch.dtype):
    if not any((path / name).is_file() for name in HF_WEIGHT_FILES):
        raise ConfigError(f"HF folder {path} has a megaloop config.json but no weights "
                              f"({' / '.join(HF_WEIGHT_FILES[:2])}): an interrupted or partial export?")
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its "newly initialized" warning: refused below, in one line
    try:
        model, info = MegaloopForCausalLM.from_pretrained(str(path), dtype=dtype, output_loading_info=True)
    except Exception as err:  # noqa: BLE001 - re-raised unless a weights file is unreadable
        bad = _damaged_weights(path, err)
        if bad is not None:
            raise ConversionError(bad) from None
        if isinstance(err, RuntimeError) and "size mismatch" in str(err):
            raise ConversionError(_mismatch(path, f"tensors of another shape ({_shape_diffs(path)})")) from None
        raise
    finally:
        hf_logging.set_verbosity(verbosity)
    wrong = [(what, sorted(info.get(key) or [])) for what, key in  # (shapes raised above)
             (("missing from the weights (they would be random)", "missing_keys"),
              ("in the weights but not in the model config.json describes (they would be dropped)",
               "unexpected_keys"))]
    if any(keys for _, keys in wrong):
        raise ConversionError(_mismatch(path, "; ".join(
            f"{len(keys)} tensor(s) {what}: {', '.join(keys[:4])}{' ...' if len(keys) > 4 else ''}"
            for what, keys in wrong if keys)))
    tok = path / "tokenizer.json"
    if tok.is_file():
        _count_added_tokens(model, tok)
    return model, {"kind": "hf", "path": str(path), "step": None, "tokenizer": str(tok) if tok.is_file() else None,
                   "validation": None}


def _count_added_tokens(model, tok: Path) -> None:
    """A folder whose tokenizer holds more tokens than ``config.tokenizer_vocab_size`` says (tokens
    added in HF fine-tuning: ``resize_token_embeddings`` before this release left the field as it was)
    has those ids counted as real (and no longer suppressed in generation), with a note; they were
    treated as padding and never generated.
    More tokens than the model has rows is refused."""
    import sys

    from tokenizers import Tokenizer

    from megaloop.hf.layers_megaloop import unpad_generation

    config = model.config
    try:
        n = Tokenizer.from_file(str(tok)).get_vocab_size(with_added_tokens=True)
    except Exception:  # noqa: BLE001 - an unreadable tokenizer is named where it is used
        return
    real, rows = int(config.tokenizer_vocab_size), int(config.vocab_size)
    if n <= real:
        return
    if n > rows:
        raise ConversionError(f"{tok}: {n} tokens, more than the model's {rows} embedding rows (config.json "
                              "vocab_size): not this model's tokenizer")
    config.tokenizer_vocab_size = n
    unpad_generation(model, real)
    print(f"note: {tok} holds {n} tokens, config.json's tokenizer_vocab_size {real} (tokens added in fine-tuning): "
          f"ids {real}..{n - 1} count as tokens, not padding", file=sys.stderr, flush=True)


def _mismatch(path: Path, what: str) -> str:
    return (f"HF folder {path}: its weights do not match its config.json: {what}; the config was edited or "
            "belongs to another export (export the checkpoint again, or restore the folder's config.json)")


def _shape_diffs(path: Path) -> str:
    """The stored tensors whose shapes differ from the model ``path``'s config.json describes (read
    from the safetensors headers and a model built on the meta device, nothing loaded)."""
    from safetensors import safe_open

    config = MegaloopForCausalLM.config_class.from_pretrained(str(path))
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in MegaloopForCausalLM(config).state_dict().items()}
    diffs = []
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as handle:
            for key in handle.keys():
                shape = tuple(handle.get_slice(key).get_shape())
                if key in expected and expected[key] != shape:
                    diffs.append(f"{key} {list(shape)} stored vs {list(expected[key])}")
    return ", ".join(diffs[:3]) + (" ..." if len(diffs) > 3 else "") if diffs else "see the weights files"


def _damaged_weights(path: Path, err: BaseException) -> Optional[str]:
    """One line naming the unreadable weights file of HF folder ``path`` when ``err`` (from
    ``from_pretrained``) comes from reading one (truncated, overwritten, not a safetensors/torch file);
    None when the error is something else."""
    import pickle

    try:
        from safetensors import SafetensorError
    except ImportError:  # older safetensors
        from safetensors._safetensors_rust import SafetensorError

    text = str(err).splitlines()[0] if str(err) else type(err).__name__
    reading = isinstance(err, (SafetensorError, EOFError, pickle.UnpicklingError, OSError, json.JSONDecodeError)) or (
        isinstance(err, RuntimeError) and any(w in str(err) for w in ("PytorchStreamReader", "deserializ", "zip")))
    if not reading:
        return None
    culprit = None
    for f in sorted(path.glob("*.safetensors")):
        try:
            from safetensors import safe_open

            with safe_open(str(f), framework="pt") as handle:
                handle.keys()
        except Exception as bad:  # noqa: BLE001 - any failure to open names the file
            culprit, text = f, str(bad).splitlines()[0] if str(bad) else type(bad).__name__
            break
    if culprit is None:
        present = [path / n for n in HF_WEIGHT_FILES if (path / n).is_file()]
        culprit = present[0] if present else path
    return (f"{culprit}: cannot read the HF folder's weights ({text}): a damaged or partial file (a truncated "
            "copy, an interrupted export?); export or copy the folder again")


def json_tokenizer(arg: Union[str, Path, None]) -> Optional[Path]:
    """``arg`` when it is a tokenizer.json or a folder holding one, else None."""
    if arg is None:
        return None
    p = Path(arg) / "tokenizer.json" if Path(arg).is_dir() else Path(arg)
    return p if p.is_file() and p.suffix == ".json" else None


def _join_launched_world(path) -> None:
    """Inside a launch of several processes (``torchrun ... megaloop rl|distill-prefill``, whose
    process group DeepSpeed already started), give megatron-core a TP=1/PP=1 layout over that whole
    world (data parallel = the launch's size), so :func:`load_native` builds the model without asking
    for a world of one. Every rank then reads the whole checkpoint (the read is collective: all ranks
    call :func:`load_model` together, as ``rl`` and ``distill-prefill`` do) into its own FP32 model."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    world = torch.distributed.get_world_size()
    if world == 1:
        return
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return
    from megaloop.hf.convert import read_run_config
    from megaloop.runtime.parallel import ParallelDims, init_distributed
    from megaloop.train.checkpoint import find_checkpoint

    run_cfg = read_run_config(find_checkpoint(path))
    init_distributed(ParallelDims(world=world), int((run_cfg.get("train") or {}).get("seed", 1234)))


@contextlib.contextmanager
def _callers_rng():
    """Put Python's, numpy's and torch's (``torch.random.fork_rng``: CPU and every CUDA device)
    generator states back afterwards: a checkpoint load seeds them all with the run's seed."""
    import random

    import numpy as np

    py, npy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []):
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)


def _from_checkpoint(path, num_recurrences: Optional[int], validate: bool, tokenizer: Optional[Path] = None):
    from megaloop.runtime.cpu_compat import redirect_active, release_redirect

    megatron_in_use = redirect_active()  # e.g. a trainer in this process: leave its CPU layer as it is
    try:
        with _callers_rng():
            _join_launched_world(path)
            native, mcfg, run_cfg, ckpt, common = load_newest(path, load_native)  # a training run may prune it
            model, tok = to_hf_model(native, mcfg, run_cfg, ckpt, num_recurrences=num_recurrences, tokenizer=tokenizer)
            check = check_conversion(native, model, seq_len=min(mcfg.seq_len, 64)) if validate else None
    finally:  # also after a failed load (the CPU layer stayed on, redirecting the caller's "cuda" tensors)
        if not megatron_in_use:  # megatron was needed to read the checkpoint only: plain PyTorch from here on
            release_redirect()
    return model, {"kind": "checkpoint", "path": str(ckpt), "step": common.get("step"),
                   "tokenizer": str(tok) if tok else None,
                   "validation": check and {k: check[k] for k in ("error", "max_abs", "depth", "seq_len", "num_seqs")}}

