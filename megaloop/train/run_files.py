"""Files a training run keeps beside its checkpoints: ``data.json`` (what data it trained on) and
``tokenizer.json`` (the tokenizer that data was tokenised with)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path


def record_data(run_dir: Path, data_path: str | Path, manifest: dict, content: dict | None) -> None:
    """``RUN/data.json``: the training data's resolved path, its build fingerprint (manifest) and
    its content fingerprint (``content``: ``megaloop.data.fingerprint.content_fingerprint``, as the
    train loader computed it), so that runs can be compared and merged knowing whether they saw the
    same samples."""
    from megaloop.runtime.files import atomic_write_json

    where = Path(str(data_path))
    atomic_write_json(Path(run_dir) / "data.json", {  # absolute: tools run from another directory read it
        "path": str(where.resolve()) if where.exists() else str(data_path),
        "manifest_fingerprint": manifest.get("fingerprint"),
        "content": content})


def recorded_content(run_dir: Path, build_fingerprint: str | None) -> str | None:
    """The content sha256 ``RUN/data.json`` recorded for the build ``build_fingerprint`` (None when
    the file is missing, unreadable, of another build or without a trustworthy content hash)."""
    import json

    try:
        rec = json.loads((Path(run_dir) / "data.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(rec, dict) or rec.get("manifest_fingerprint") != build_fingerprint:
        return None
    content = rec.get("content")
    return content.get("sha256") if isinstance(content, dict) and content.get("hashed") else None


def keep_tokenizer(run_dir: Path, manifest: dict, data_path: str | Path, configured: str) -> Path | None:
    """Copy the data's tokenizer.json into ``RUN/tokenizer.json`` once (evaluation and HF export find
    it there, ``hf.convert.find_tokenizer``, even after the data or the embedded corpus of a newer
    megaloop changes). A path in the manifest may be relative to the dataset's folder
    (``data_path``). A file whose sha256 is not the one the manifest records (replaced since the
    data was tokenised) is not copied: a warning names it and ``configured`` (``data.path``).
    Returns the copy, or None when nothing was copied."""
    from megaloop.data.tokenizer import file_sha256, manifest_tokenizer_sha256

    entry = manifest.get("tokenizer")
    src = entry.get("path") if isinstance(entry, dict) else None
    dst = Path(run_dir) / "tokenizer.json"
    if not src or dst.exists():
        return None
    if not Path(src).is_absolute() and not Path(src).is_file():
        src = str(Path(str(data_path)) / src)
    if not Path(src).is_file():  # moved or deleted since the conversion: said, as a replaced one is
        print(f"warning: the tokenizer data.path={configured} was tokenised with ({entry.get('path')}, its "
              f"manifest.json 'tokenizer') is not there; not copied into {dst}: pass --tokenizer with that file "
              "to eval, generate and convert", file=sys.stderr, flush=True)
        return None
    want, have = manifest_tokenizer_sha256(manifest), file_sha256(src)
    if want and have != want:
        print(f"warning: {src} is not the tokenizer data.path={configured} was tokenised with (sha256 "
              f"{have[:12]}…, the manifest records {want[:12]}…); not copied into {dst}: pass --tokenizer "
              "with the right file to eval, generate and convert", file=sys.stderr, flush=True)
        return None
    tmp = dst.with_name(f".tokenizer.json.tmp-{os.getpid()}")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)
    return dst


def same_tokenizer(a: Path, b: Path) -> bool:
    """Whether two tokenizer.json files tokenise alike: equal but for their ``padding`` and
    ``truncation`` blocks, which transformers adds when a tokenizer is used with ``padding=True``
    before ``save_pretrained`` (the vocabulary and merges unchanged, the sha256 not)."""
    def core(p: Path) -> dict | None:
        try:
            d = json.loads(Path(p).read_text())
        except (OSError, ValueError):
            return None
        return {k: v for k, v in d.items() if k not in ("padding", "truncation")} if isinstance(d, dict) else None

    x = core(a)
    return x is not None and x == core(b)


def init_tokenizer_warning(init_path: Path, saved_config: dict, manifest: dict,
                           data_path: str | Path | None = None) -> str | None:
    """A warning when the checkpoint of ``train.init_weights`` (its run's config ``saved_config``) was
    trained with another tokenizer than the data's (``manifest``): its embeddings then map other ids
    (an earlier release's embedded corpus, or another tokenizer of the same size, started silently;
    deliberate for a vocabulary transplant, hence a warning). None when they agree or one is unknown."""
    from megaloop.data.tokenizer import file_sha256, manifest_tokenizer_sha256
    from megaloop.hf.convert import find_tokenizer
    from megaloop.hf.errors import ConversionError

    want = manifest_tokenizer_sha256(manifest)
    if not want or not saved_config:
        return None
    try:
        own = find_tokenizer(saved_config, Path(init_path))
    except ConversionError as err:  # an earlier release's embedded corpus, a tokenizer that moved
        why = str(err).split("; pass --tokenizer")[0]  # eval's advice; here the weights are what matter
        return f"{why}; as train.init_weights its embeddings map other token ids than this data's"
    except Exception:  # noqa: BLE001 - a warning never stops a run (an old run's cache_dir gone, ...)
        return None
    if own is None or not own.is_file() or file_sha256(own) == want:
        return None
    entry = manifest.get("tokenizer")  # the data's own file, found as keep_tokenizer finds it
    src = Path(entry["path"]) if isinstance(entry, dict) and isinstance(entry.get("path"), str) else None
    if src is not None and not src.is_absolute() and not src.is_file() and data_path is not None:
        src = Path(str(data_path)) / src
    if src is not None and src.is_file() and file_sha256(src) == want and same_tokenizer(own, src):
        return None  # the same tokenizer, saved again by transformers
    return (f"train.init_weights={init_path} was trained with tokenizer {own} (sha256 {file_sha256(own)[:12]}…), "
            f"the data with {want[:12]}…: its embeddings map other token ids")
