"""Small filesystem helpers: advisory locks, atomic JSON writes, stable hashes."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator


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


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temp file in the same directory, fsync, rename."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_json(path: str | Path, obj: Any) -> None:
    """Atomically write ``obj`` as indented, key-sorted JSON."""
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def json_sha(obj: Any) -> str:
    """Stable SHA-256 of a JSON-able object (key-sorted)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def rmtree_quiet(path: str | Path) -> None:
    """``shutil.rmtree`` that ignores a missing path."""
    shutil.rmtree(path, ignore_errors=True)
