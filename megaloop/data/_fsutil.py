"""Small filesystem and process helpers: advisory locks, stable hashes, the setup of data-prep pool
workers (atomic writes: megaloop.runtime.files)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from megaloop.runtime.files import atomic_write_json, atomic_write_text, cannot_create_in, dangling_link, \
    nearest_existing  # noqa: F401  (atomic_write_* re-exported)

__all__ = ["atomic_write_json", "atomic_write_text", "check_out_writable", "die_with_parent", "file_lock",
           "first_missing", "init_pool_worker", "json_sha", "lock_holder", "rmtree_quiet", "try_lock_fd"]


_HELD_LOCK_FDS: set[int] = set()  # fds of the file_lock()s this process holds (or waits for)


def _drop_held_locks_in_child() -> None:
    """After ``fork``: close the child's copies of the parent's lock fds. An ``flock`` belongs to
    the open file description, so a forked worker keeping a copy would keep the lock held after the
    parent died (a rerun would wait for the orphan). Closing a copy never unlocks the parent."""
    for fd in list(_HELD_LOCK_FDS):
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD_LOCK_FDS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_held_locks_in_child)


def init_pool_worker(parent: int) -> None:
    """Initializer of a data-prep ``multiprocessing`` pool worker forked by process ``parent``.

    A signal handler the parent installed (a CLI's SIGTERM) is not the worker's: SIGTERM is reset to
    its default (``Pool.terminate`` ends the worker). Ctrl-C reaches the whole process group and the
    parent then stops the pool, so workers ignore SIGINT (no traceback per worker). The worker ends
    when ``parent`` dies, however it dies (:func:`die_with_parent`)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(parent)


def die_with_parent(parent: int) -> None:
    """End this worker when its parent process ``parent`` dies (killed, even with SIGKILL), instead
    of working on as an orphan that cannot report back. Linux: the kernel sends SIGTERM
    (``PR_SET_PDEATHSIG``); elsewhere a thread polls the parent id."""
    try:
        import ctypes

        armed = ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0) == 0  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        armed = False
    if os.getppid() != parent:  # it died before the request took effect
        os._exit(1)
    if not armed:
        import threading

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(0.5)
            os._exit(1)

        threading.Thread(target=watch, name="megaloop-parent-watch", daemon=True).start()


def lock_holder() -> str:
    """``"pid N on HOST"``: what :func:`file_lock` records in a lock file it holds."""
    return f"pid {os.getpid()} on {socket.gethostname()}"


def _removed(fd: int) -> bool:
    """Whether the file open as ``fd`` has been removed (a lock file its holder removed while this
    process waited for it is not the lock any more: the next process creates a new one)."""
    try:
        return os.fstat(fd).st_nlink == 0
    except OSError:
        return False


@contextlib.contextmanager
def file_lock(path: str | Path, busy: str | None = None,
              drop_if: Callable[[], bool] | None = None) -> Iterator[None]:
    """Exclusive ``flock`` on ``path`` (created if needed); blocks until acquired.

    Works across processes and across threads of one process (each call opens its own
    file description). Not inherited: a process forked while the lock is held does not hold it.

    ``busy``: what to say when another process holds the lock; then one line ``note: {busy}
    (pid N on HOST); waiting for it to finish (lock PATH)`` goes to stderr before waiting, and
    the holder is recorded in the lock file while this process holds it.

    ``drop_if``: called on release while the lock is still held; when it returns true the lock file
    is removed (e.g. a failed run leaves its ``--out`` as empty as it found it). A process that was
    waiting for a removed lock file notices (after each acquisition it checks that the file it locked
    still has a name) and locks the new one, so two processes never both hold ``path``.
    """
    path = Path(path)
    owner, held, told = os.getpid(), False, False
    while True:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        _HELD_LOCK_FDS.add(fd)  # before the flock: a fork from another thread must not copy it locked
        try:
            if busy is None:
                fcntl.flock(fd, fcntl.LOCK_EX)
            else:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    if not told:
                        try:
                            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
                        except OSError:
                            holder = ""
                        who = f" ({holder})" if holder else ""
                        print(f"note: {busy}{who}; waiting for it to finish (lock {path})", file=sys.stderr,
                              flush=True)
                        told = True
                    fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            _HELD_LOCK_FDS.discard(fd)
            os.close(fd)
            raise
        if not _removed(fd):
            break
        _HELD_LOCK_FDS.discard(fd)  # the holder removed the file it locked: lock the current one
        os.close(fd)
    try:
        if busy is not None:
            held = True
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{lock_holder()}\n".encode(), 0)
        yield
    finally:
        if os.getpid() == owner:  # a forked child that unwinds this frame never held the lock
            _HELD_LOCK_FDS.discard(fd)
            try:
                if held:
                    with contextlib.suppress(OSError):
                        os.ftruncate(fd, 0)  # no stale holder for the next waiter to name
                if drop_if is not None:
                    with contextlib.suppress(OSError):
                        if drop_if():
                            os.unlink(path)
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


def check_out_writable(out: str | Path, flag: str = "--out") -> None:
    """Refuse, in one line naming ``flag``, an output folder this process cannot create or write
    into, before any work: ``out`` itself when it exists, else the nearest folder above it that
    exists, probed with a temporary file (created and removed at once) — permission bits alone do
    not tell for root, a read-only mount or a pseudo file system such as ``/proc``."""
    from megaloop.data.errors import DataError

    out = Path(out)
    probe = nearest_existing(out)
    if link := dangling_link(probe):
        raise DataError(f"{flag} {out}: {link}")
    if not probe.is_dir():
        if probe == out:
            raise DataError(f"{flag} {out} exists and is not a directory")
        raise DataError(f"{flag} {out}: {probe} is a file, not a folder, so {out} cannot be created")
    why = cannot_create_in(probe)
    if why is not None:
        where = f"({why})" if probe == out else f"(no file can be created in {probe}: {why})"
        raise DataError(f"{flag} {out}: not writable {where}; give a folder you can write to")
