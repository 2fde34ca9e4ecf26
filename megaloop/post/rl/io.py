"""Tokenizers of RL policies / distillation teachers (``bytes``, files, the model's own), output
folders (``--out``, HF folders). The models themselves load through :func:`megaloop.hf.load.load_model`."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

from megaloop.post.rl.tasks import ByteTokenizer, TextTokenizer


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
    """The tokenizer for a model from :func:`megaloop.hf.load.load_model` (``source``): ``explicit``
    (``--tokenizer``), else the HF folder's own, else the one its checkpoint's run used; None if none."""
    tok = load_tokenizer(explicit, fallback_dir=model_path if source["kind"] == "hf" else None)
    if tok is None and source.get("tokenizer"):
        tok = load_tokenizer(source["tokenizer"])
    return tok


def early_tokenizer(explicit: str | Path | None, model_path: str | Path) -> TextTokenizer | None:
    """The tokenizer :func:`model_tokenizer` will give, where it can be told before the model loads:
    ``explicit`` (``--tokenizer``) or an HF folder's own; None for a checkpoint's run tokenizer (known
    once the checkpoint is read)."""
    from megaloop.hf.load import is_hf_folder

    if explicit is not None:
        return load_tokenizer(explicit)
    return load_tokenizer(None, fallback_dir=model_path) if is_hf_folder(model_path) else None


def tokenizer_identity(tok: TextTokenizer) -> dict:
    """What a run records of its tokenizer (compared on ``--resume``): ``tokenizer``, the file used
    (absolute) or ``bytes``, and ``tokenizer_sha256``, the SHA-256 of that file (``bytes`` for bytes)."""
    if isinstance(tok, ByteTokenizer):
        return {"tokenizer": "bytes", "tokenizer_sha256": "bytes"}
    path = getattr(tok, "path", None)
    return {"tokenizer": str(Path(path).resolve()) if path is not None else type(tok).__name__,
            "tokenizer_sha256": getattr(tok, "sha256", None)}


def add_run_folder_args(p, stages: str, what: str) -> None:
    """``--deepspeed`` (``stages``: the ZeRO configs the command accepts), ``--save-every``,
    ``--resume``, ``--overwrite``: the run-folder options of ``megaloop rl`` / ``distill-prefill``."""
    p.add_argument("--deepspeed", default=None, metavar="CONFIG",
                   help=f"DeepSpeed JSON config (or {stages}, the shipped ones): train under a ZeRO engine")
    p.add_argument("--save-every", type=int, default=0,
                   help="checkpoint every N steps (and at the end) in OUT/checkpoints; a stop on SIGTERM/SIGUSR1/"
                        "Ctrl-C checkpoints there whatever N (exit 75/130; continue with --resume)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in OUT/checkpoints")
    p.add_argument("--overwrite", action="store_true",
                   help=f"replace the {what} already in --out (only this command's own runs); without it such "
                        "an --out is refused")
    # the deepspeed launcher passes --local_rank=N (unless --no_local_rank); the rank is read from the
    # environment (LOCAL_RANK, which it sets too), so the option is accepted and ignored. With
    # `--module megaloop.cli` it lands before the subcommand, where megaloop.cli drops it
    p.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, default=None, help=argparse.SUPPRESS)


# the files named when --out already holds a run of the command's own (rl | student: megaloop.post.runs.OWN)
OWN_MARKERS = {"rl": ("metrics.jsonl", "megaloop_rl.json"), "student": ("metrics.jsonl", "student.json")}


def check_out(out: Path, own: str, *, resume: bool, overwrite: bool, model: str | Path | None = None,
              model_flag: str = "--model") -> Path:
    """``out/checkpoints`` of a run folder (``--out``) of the command whose runs are ``own`` (``rl`` |
    ``student``); :class:`ConfigError` first when ``--out`` is (or lies under) a file, when it is
    not writable, when it is the input ``model``, when it holds another tool's folder (a pretraining
    run, the other command's run, an HF model that is no run: :func:`megaloop.post.runs.folder_holds`;
    neither ``--resume`` nor ``--overwrite`` acts on those), when it already holds a run of its own
    without ``--resume`` / ``--overwrite``, when both are given, or when ``--resume`` finds no checkpoint."""
    from megaloop.config_utils import ConfigError
    from megaloop.post.runs import OWN, check_owner, check_writable
    from megaloop.runtime.files import dangling_link

    out = Path(out)
    for p in (out, *out.parents):
        if p.exists() or p.is_symlink():
            if link := dangling_link(p):
                raise ConfigError(f"--out {out}: {link}; give a folder you can write to")
            if not p.is_dir():
                where = "is a file" if p == out else f"lies under {p}, which is a file"
                raise ConfigError(f"--out {out} {where}; give a folder")
            break
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite exclude each other")
    if model is not None:
        try:
            same = Path(model).exists() and out.resolve() == Path(model).resolve()
        except OSError:
            same = False
        if same:
            raise ConfigError(f"--out {out} is {model_flag} {model}: writing there would overwrite the "
                              "input model; give another --out")
    held = check_owner(out, own, resume=resume, overwrite=overwrite)
    if not resume and not overwrite and held is not None:
        markers = [m for m in OWN_MARKERS[own] if (out / m).exists()] or ["checkpoints"]
        raise ConfigError(f"--out {out} already holds {OWN[own]} ({' / '.join(markers)}); pass --resume to "
                          "continue it or --overwrite to replace it")
    ckpt = out / "checkpoints"
    if resume and not (ckpt.is_dir() and any(ckpt.iterdir())):
        raise ConfigError(f"--resume: no checkpoint in {ckpt}")
    check_writable(out)
    return ckpt


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
    from megaloop.runtime.files import plain_mode

    plain_mode(*out.glob("model*.safetensors"), out / "model.safetensors.index.json")
    for name in CODE_FILES:
        shutil.copyfile(HF_DIR / name, out / name)
    tok_path = getattr(tokenizer, "path", None)
    written = []
    if tok_path is not None and Path(tok_path).suffix == ".json":
        src_cfg = Path(tok_path).parent / "tokenizer_config.json"
        if src_cfg.is_file():  # an HF folder's tokenizer: its files as they are
            for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
                if (Path(tok_path).parent / name).is_file() or name == "tokenizer.json":
                    written.append(name)
                    shutil.copyfile(tok_path if name == "tokenizer.json" else Path(tok_path).parent / name, out / name)
        else:  # a megaloop run's bare tokenizer.json: wrapped as `megaloop convert` does, so AutoTokenizer
            from megaloop.hf.tokenizer_files import save_tokenizer  # loads it (it refused a folder without a config)

            cfg = model.config
            names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
            for n in names:  # what this save writes is what exists after it (a stale copy is dropped below)
                (out / n).unlink(missing_ok=True)
            save_tokenizer(Path(tok_path), out, {"eos": cfg.eos_token_id, "bos": getattr(cfg, "bos_token_id", None),
                                                 "pad": getattr(cfg, "pad_token_id", None)},
                           int(getattr(cfg, "max_position_embeddings", 0) or 0) or 2048)
            written += [n for n in names if (out / n).is_file()]
    elif isinstance(tokenizer, ByteTokenizer):
        written.append("megaloop_tokenizer.json")
        (out / "megaloop_tokenizer.json").write_text(json.dumps({"spec": "bytes"}))
    _drop_stale_tokenizer(out, written)
    if extra:
        from megaloop.runtime.files import atomic_write_text

        atomic_write_text(out / "megaloop_rl.json", json.dumps({**extra, "tokenizer_files": written}, indent=1,
                                                               default=str))
    return out


# the tokenizer files an RL save (save_hf) may write
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "megaloop_tokenizer.json")


def _drop_stale_tokenizer(out: Path, written: list[str]) -> None:
    """Remove the tokenizer files an earlier save into ``out`` left that this one did not write (an
    ``--overwrite`` with another ``--tokenizer``), so the folder holds one tokenizer, the weights'. Only
    files of that save go: those its ``megaloop_rl.json`` lists (any of :data:`TOKENIZER_FILES` for one
    written before the list was kept); nothing is removed from a folder no RL save wrote."""
    try:
        before = json.loads((out / "megaloop_rl.json").read_text())
    except (OSError, ValueError):
        return
    listed = before.get("tokenizer_files") if isinstance(before, dict) else None
    for name in set(listed if isinstance(listed, list) else TOKENIZER_FILES) & set(TOKENIZER_FILES) - set(written):
        (out / name).unlink(missing_ok=True)


def warn_rope_extrapolation(model, length: int, what: str) -> bool:
    """One stderr warning (as eval and generate give) when ``length`` positions exceed the model's
    training length (``max_position_embeddings``): RoPE positions past it were never trained."""
    trained = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    if not trained or length <= trained:
        return False
    print(f"warning: {what} reach {length} positions, past the training seq_len {trained}: RoPE positions "
          f"{trained}..{length - 1} were never trained and are extrapolated", file=sys.stderr, flush=True)
    return True
