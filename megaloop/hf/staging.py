"""The staging folder of an export (``megaloop convert``): the HF folder is written and checked in
``.<out>.megaloop-tmp-<host>-<pid>/<out>`` beside ``--out`` and renamed onto it whole, so ``--out``
is never half-written. A convert that was killed (SIGKILL, a node failure) leaves its staging
folder behind; the next convert into the same ``--out`` on the same host removes those whose
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
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in socket.gethostname()) or "host"


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
        if owner != host or not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)) or not st.is_dir():
            continue
        old = st / f"{out.name}.old"
        if old.is_dir() and not out.exists():
            old.rename(out)
            log(f"note: restored the earlier export {out} that an interrupted convert (pid {pid}) had moved aside")
        shutil.rmtree(st, ignore_errors=True)
        log(f"note: removed {st}, the staging folder of an interrupted convert (pid {pid})")
