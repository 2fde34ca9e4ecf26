"""Content fingerprint of a local MDS dataset: equal for two builds of the same tokens.

``manifest.json``'s ``fingerprint`` identifies a *build* (it hashes the inputs' sizes and mtimes,
so that a rerun of the converter can skip finished parts); two builds of the same source on two
days differ there. What a comparison of runs needs is whether they trained on the same samples:
:func:`content_fingerprint` hashes the dataset's ``index.json`` shard list — each shard's name,
sample count, byte size and the content hash the writer recorded (xxh64; the converter records
one for every shard), else the SHA-256 of the shard file itself while the unhashed shards total at
most ``HASH_LIMIT_BYTES`` (beyond that, names, counts and sizes only: ``hashed`` false).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from megaloop.data._fsutil import json_sha

__all__ = ["content_fingerprint", "HASH_LIMIT_BYTES"]

HASH_LIMIT_BYTES = 256 << 20  # read at most this much of shards without a recorded hash


def _file_sha(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def content_fingerprint(path: str | Path) -> dict | None:
    """``{"sha256", "shards", "samples", "hashed"}`` of the MDS dataset at ``path`` (a local
    directory with an ``index.json``); None for a remote URL or a directory without an index."""
    if "://" in str(path):
        return None
    root = Path(path)
    index = root / "index.json"
    if not index.is_file():
        return None
    shards = json.loads(index.read_text()).get("shards") or []
    recorded = [(s.get("raw_data") or {}).get("hashes") or (s.get("zip_data") or {}).get("hashes")
                for s in shards]
    files = [s["zip_data"] if (s.get("zip_data") or {}).get("basename") else s.get("raw_data") or {}
             for s in shards]
    read_files = sum(int(f.get("bytes") or 0) for f, h in zip(files, recorded) if not h) <= HASH_LIMIT_BYTES
    entries = []
    for s, digest, stored in zip(shards, recorded, files):
        if not digest and read_files:
            f = root / stored["basename"]
            digest = {"sha256": _file_sha(f)} if f.is_file() else {"missing": stored["basename"]}
        raw = s.get("raw_data") or {}
        entries.append([raw.get("basename"), int(s.get("samples", 0)), raw.get("bytes"), digest or None])
    return {"sha256": json_sha(entries), "shards": len(entries), "samples": sum(e[1] for e in entries),
            "hashed": read_files or all(recorded)}
