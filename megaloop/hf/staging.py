"""The staging folder of an export (``megaloop convert``): the HF folder is written and checked in
``.<out>.megaloop-tmp-<host>-<pid namespace>-<pid>/<out>`` beside ``--out`` and renamed onto it
whole, so ``--out`` is never half-written. A convert that was killed (SIGKILL, a node failure)
leaves its staging folder behind; the next convert into the same ``--out`` from the same host and
pid namespace removes those whose
process is gone, and puts back an earlier export that the killed one had moved aside to replace it
(``<out>.old`` inside the staging folder, when ``--out`` itself is missing)."""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path
from typing import Callable

_TAG = ".megaloop-tmp-"


def _host() -> str:
    """Where a pid means this process: the host name and the pid namespace (two containers may share
    a host name with separate pids: each would take the other's live pid for a dead one)."""
    name = "".join(c if c.isalnum() or c in "_" else "_" for c in socket.gethostname()) or "host"
    try:
        return f"{name}-{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return name


def staging_dir(out: Path) -> Path:
    """This process's staging folder for ``out``."""
    return out.with_name(f".{out.name}{_TAG}{_host()}-{os.getpid()}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def sweep_stale(out: Path, log: Callable[[str], None] = print) -> None:
    """Remove the staging folders of ``out`` left by converts on this host whose process is gone,
    restoring an earlier export one of them had moved aside (``out`` missing). Folders of another
    host, or of a live process, are left alone."""
    host = _host()
    for st in sorted(out.parent.glob(f".{out.name}{_TAG}*")):
        tail = st.name[len(f".{out.name}{_TAG}"):]
        owner, _, pid = tail.rpartition("-")
        if owner != host or not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)) \
                or st.is_symlink() or not st.is_dir():
            continue
        put_back(out, st, lambda text: log(f"{text} (pid {pid})"))
        shutil.rmtree(st, ignore_errors=True)
        if not st.exists():
            log(f"note: removed {st}, the staging folder of an interrupted convert (pid {pid})")


def put_back(out: Path, staging: Path, log: Callable[[str], None] = print) -> None:
    """Rename the earlier export that a convert moved aside into ``staging`` back to ``out``, when
    ``out`` is missing (the convert stopped between moving it aside and renaming the new one in)."""
    old = staging / f"{out.name}.old"
    if old.is_dir() and not out.exists() and not out.is_symlink():
        old.rename(out)
        log(f"note: restored the earlier export {out} that an interrupted convert had moved aside")
