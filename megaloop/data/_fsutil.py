"""Small filesystem helpers: advisory locks, stable hashes (atomic writes: megaloop.runtime.files)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

from megaloop.runtime.files import atomic_write_json, atomic_write_text  # noqa: F401  (used by megaloop.data)


@contextlib.contextmanager
def file_lock(path: str | Path) -> Iterator[None]:
    """Exclusive ``flock`` on ``path`` (created if needed); blocks until acquired.

    Works across processes and across threads of one process (each call opens its own
    file description).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def try_lock_fd(path: str | Path) -> int | None:
    """Non-blocking exclusive ``flock``; returns the open fd holding it, or None if taken."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def json_sha(obj: Any) -> str:
    """Stable SHA-256 of a JSON-able object (key-sorted)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def rmtree_quiet(path: str | Path) -> None:
    """``shutil.rmtree`` that ignores a missing path."""
    shutil.rmtree(path, ignore_errors=True)


def first_missing(path: Path) -> Path | None:
    """The topmost ancestor-or-self of ``path`` that does not exist yet (None: ``path`` exists): what
    a ``mkdir -p`` of ``path`` would create, so a failed run can remove exactly that."""
    missing = None
    for p in (Path(path), *Path(path).parents):
        if p.exists():
            break
        missing = p
    return missing
