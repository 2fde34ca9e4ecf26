"""Load a policy/teacher (megaloop checkpoint or HF folder) with its tokenizer; save HF folders."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from megaloop.rl.tasks import ByteTokenizer, TextTokenizer


def is_hf_dir(path: str | Path) -> bool:
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return False
    try:
        return json.loads(cfg.read_text()).get("model_type") == "megaloop"
    except json.JSONDecodeError:
        return False


def load_tokenizer(spec: str | Path | None, fallback_dir: str | Path | None = None) -> TextTokenizer | None:
    """``bytes`` → :class:`ByteTokenizer`; a tokenizer file/dir or ``default`` → megaloop's
    :class:`~megaloop.data.tokenizer.Tokenizer`; None → the one in ``fallback_dir`` if any."""
    from megaloop.data.tokenizer import load_tokenizer as _load

    if spec is None:
        if fallback_dir is not None and (Path(fallback_dir) / "tokenizer.json").is_file():
            return _load(fallback_dir)
        if fallback_dir is not None and (Path(fallback_dir) / "megaloop_tokenizer.json").is_file():
            return load_tokenizer(json.loads((Path(fallback_dir) / "megaloop_tokenizer.json").read_text())["spec"])
        return None
    if str(spec) == "bytes":
        return ByteTokenizer()
    if str(spec) == "default":
        from megaloop.data.default_corpus import ensure_default_tokenizer

        return _load(ensure_default_tokenizer())
    return _load(spec)


def model_tokenizer(explicit: str | Path | None, model_path: str | Path, source: dict) -> TextTokenizer | None:
    """The tokenizer for a model from :func:`load_model`: ``explicit`` (``--tokenizer``), else the
    HF folder's own, else the one its checkpoint's run used; None if none is found."""
    tok = load_tokenizer(explicit, fallback_dir=model_path if source["kind"] == "hf" else None)
    if tok is None and source.get("tokenizer"):
        tok = load_tokenizer(source["tokenizer"])
    return tok


def check_model_path(path: str | Path, flag: str = "--model") -> str:
    """``"hf"`` or ``"checkpoint"`` for a loadable model path, else :class:`ConfigError` (one line
    naming ``flag`` and the path): missing, an empty directory, a file, or neither kind."""
    from megaloop.config_utils import ConfigError

    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{flag} {p}: no such file or directory")
    if not p.is_dir():
        raise ConfigError(f"{flag} {p}: is a file, not an HF folder or a megaloop checkpoint")
    if not any(p.iterdir()):
        raise ConfigError(f"{flag} {p}: is an empty directory, not an HF folder or a megaloop checkpoint")
    if is_hf_dir(p):
        return "hf"
    from megaloop.train.checkpoint import CheckpointError, find_checkpoint

    try:
        find_checkpoint(p)
    except CheckpointError as err:
        raise ConfigError(f"{flag} {p}: neither an HF folder (config.json with model_type \"megaloop\") nor "
                          f"a megaloop checkpoint ({str(err).splitlines()[0]})") from None
    return "checkpoint"


def load_model(path: str | Path, *, dtype: torch.dtype = torch.float32, num_recurrences: int | None = None,
               flag: str = "--model"):
    """``(MegaloopForCausalLM in eval mode, source description)`` from an HF folder or a megaloop
    checkpoint (step dir, ``RUN/checkpoints`` or ``RUN``; converted in memory, no validation).
    A path that is neither, or a checkpoint that cannot be converted, raises ``ConfigError``."""
    from megaloop.config_utils import ConfigError
    from megaloop.hf.modeling_megaloop import MegaloopForCausalLM

    path = Path(path)
    if check_model_path(path, flag) == "hf":
        model = MegaloopForCausalLM.from_pretrained(str(path), dtype=dtype)
        source = {"kind": "hf", "path": str(path)}
    else:
        from megaloop.hf.convert import ConversionError, hf_config_from_native, load_native, native_to_hf_state_dict

        try:
            native, mcfg, run_cfg, ckpt, common = load_native(path)
        except ConversionError as err:
            raise ConfigError(f"{flag} {path}: {str(err).splitlines()[0]}") from None
        depth = int(num_recurrences or (run_cfg.get("train") or {}).get("eval_depth") or 5)
        cfg = hf_config_from_native(mcfg, vocab_size=native.vocab_size,
                                    tokenizer_vocab_size=mcfg.vocab_size or native.vocab_size,
                                    num_recurrences=depth)
        with torch.device("meta"):
            model = MegaloopForCausalLM(cfg)
        sd = {k: v.float() for k, v in native_to_hf_state_dict(native.state_dict(), mcfg).items()}
        missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
        if missing or unexpected:
            raise RuntimeError(f"weight mapping mismatch: missing {missing}, unexpected {unexpected}")
        model.tie_weights()
        model = model.to(dtype)
        source = {"kind": "checkpoint", "path": str(ckpt), "step": common.get("step")}
        source["tokenizer"] = _checkpoint_tokenizer(run_cfg, ckpt)
    if num_recurrences is not None:
        model.config.num_recurrences = int(num_recurrences)
    return model.eval(), source


def _checkpoint_tokenizer(run_cfg: dict, ckpt: Path) -> str | None:
    from megaloop.hf.convert import find_tokenizer

    try:
        tok = find_tokenizer(run_cfg, ckpt)
    except Exception:  # noqa: BLE001 - a missing tokenizer is reported by the caller
        return None
    return str(tok) if tok is not None else None


def save_hf(model: torch.nn.Module, out: str | Path, tokenizer: TextTokenizer | None = None,
            extra: dict | None = None) -> Path:
    """Save an HF folder loadable with ``trust_remote_code`` (code files and tokenizer copied)."""
    from megaloop.hf.convert import CODE_FILES, HF_DIR

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    eos = getattr(tokenizer, "eos_id", None)
    if eos is not None and getattr(model.config, "eos_token_id", None) is None:
        model.config.eos_token_id = eos
        model.generation_config.eos_token_id = eos
        if model.generation_config.pad_token_id is None:
            model.generation_config.pad_token_id = eos
    model.save_pretrained(str(out), safe_serialization=True)
    for name in CODE_FILES:
        shutil.copyfile(HF_DIR / name, out / name)
    tok_path = getattr(tokenizer, "path", None)
    if tok_path is not None and Path(tok_path).suffix == ".json":
        shutil.copyfile(tok_path, out / "tokenizer.json")
        src_cfg = Path(tok_path).parent / "tokenizer_config.json"
        if src_cfg.is_file():
            shutil.copyfile(src_cfg, out / "tokenizer_config.json")
    elif isinstance(tokenizer, ByteTokenizer):
        (out / "megaloop_tokenizer.json").write_text(json.dumps({"spec": "bytes"}))
    if extra:
        (out / "megaloop_rl.json").write_text(json.dumps(extra, indent=1, default=str))
    return out
