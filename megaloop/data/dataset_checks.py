"""Checks of where data is read and cached, before any is: the cache folder (``data.cache_dir`` /
``$MEGALOOP_CACHE``) and what a folder without megaloop's ``manifest.json`` is instead (another
tool's MDS set, one part of a dataset, an unfinished conversion, held-out sets, a raw TxT360 tree)."""

from __future__ import annotations

import os
from pathlib import Path

from megaloop.config_utils import ConfigError


def default_cache_dir() -> Path:
    """``$MEGALOOP_CACHE`` or ``~/.cache/megaloop``."""
    return Path(os.environ.get("MEGALOOP_CACHE") or Path.home() / ".cache" / "megaloop")


def check_cache_dir(cache_dir: str | Path | None) -> None:
    """:class:`ConfigError` naming ``data.cache_dir`` (or ``$MEGALOOP_CACHE``, or the default) when no
    file can be created under it: it was a ``NotADirectoryError`` / ``FileNotFoundError`` traceback
    when the first shard was decompressed or the embedded corpus built."""
    from megaloop.runtime.files import folder_problem

    root = Path(cache_dir) if cache_dir else default_cache_dir()
    what = ("data.cache_dir" if cache_dir else "$MEGALOOP_CACHE" if os.environ.get("MEGALOOP_CACHE")
            else "the default cache (set $MEGALOOP_CACHE or data.cache_dir)")
    if (why := folder_problem(root)) is not None:
        raise ConfigError(f"{what}: {root}: {why}")


def missing_manifest_hint(d: Path) -> str:
    """What folder ``d`` (no ``manifest.json``) holds instead of a dataset, as `` (...)``, or ``""``."""
    index = (d / "index.json").is_file()
    held = [d / sub for sub in ("val", "screen") if (d / sub / "manifest.json").is_file()]
    if index and d.parent.name == "parts" and (d.parent.parent / "manifest.json").is_file():
        return f" (it is one part of the dataset {d.parent.parent}: give that folder)"
    if index and (d / "parts").is_dir():
        return " (index.json exists: the conversion did not finish; rerun it)"
    if index:  # an MDS set another tool wrote (MDSWriter alone writes no manifest)
        return (" (an MDS set without megaloop's manifest.json, which records seq_len, vocab_size and the "
                "tokenizer: convert the text with data_prep/txt360_to_mds.py)")
    if held:
        return f" (it holds the held-out sets {', '.join(map(str, held))}: give one of them)"
    if (d / "data").is_dir() and any((d / "data").rglob("*.jsonl*")):
        return (" (it holds a raw TxT360-layout tree, data/<source>/.../*.jsonl: convert it first with "
                "data_prep/txt360_to_mds.py, README \"Data\")")
    return ""
