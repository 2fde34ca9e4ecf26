"""Atomic file writes: a reader never sees a half-written file (temp file, fsync, rename): text, JSON,
or whatever a writer that takes a file name writes (``torch.save``, safetensors); figures. And the
checks an output path gets before any work: where it would be created (:func:`nearest_existing`),
a dangling link on the way (:func:`dangling_link`), a folder no file can be created in
(:func:`cannot_create_in`)."""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable


def nonempty_path(text: str) -> str:
    """argparse ``type`` of an output folder option: an empty value (``--out "$OUT"`` with the
    variable unset) would mean the working directory and scatter a run or a sweep into it."""
    if not text.strip():
        import argparse

        raise argparse.ArgumentTypeError("empty path (an unset shell variable?); give a folder")
    return text


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temp file in the same directory, fsync, rename. The file
    gets the mode a plain ``open`` would give it (0666 less the umask), not mkstemp's 0600."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_file(path: str | Path, write: Callable[[str], Any]) -> None:
    """Write ``path`` whole or not at all with ``write(tmp)``, a writer that takes a file name
    (``torch.save``, safetensors' ``save_file``): ``tmp`` is a temp file in the same directory, then
    fsync, rename. The file gets the mode a plain ``open`` would give it (0666 less the umask), set
    after the writer ran (one that creates the file anew would otherwise keep mkstemp's 0600)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def nearest_existing(path: str | Path) -> Path:
    """``path`` itself or its nearest ancestor that exists, where an output that does not exist yet
    would be created. A link counts as existing even when it points nowhere, so a dangling link is
    found (and refused by :func:`dangling_link`), not walked past to a writable folder above it."""
    probe = Path(path)
    while not os.path.lexists(probe) and probe.parent != probe:
        probe = probe.parent
    return probe


def dangling_link(path: str | Path) -> str | None:
    """``"P is a link to T, which does not exist"`` when ``path`` is a link whose target is missing
    (nothing can be created through it: ``mkdir`` says "File exists"), else None."""
    path = Path(path)
    if not path.is_symlink() or path.exists():
        return None
    target = os.readlink(path)
    try:
        os.stat(path)
    except OSError as err:
        if err.errno == errno.ELOOP:
            return f"{path} is a link to {target} that leads back to itself (a loop of links)"
    if os.path.islink(os.path.join(path.parent, target)):  # a chain: name where it ends
        return f"{path} is a link to {target}, which leads to {os.path.realpath(path)}, which does not exist"
    return f"{path} is a link to {target}, which does not exist"


@functools.cache
def cannot_create_in(folder: str | Path) -> str | None:
    """Why no file can be created in ``folder`` (the OS's reason), or None when one can: a temporary
    file is created and removed at once, since permission bits alone do not tell for root, a
    read-only mount or a pseudo file system such as ``/proc``."""
    try:
        fd, name = tempfile.mkstemp(prefix=".megaloop-write-probe-", dir=folder)
    except OSError as err:
        return err.strerror or str(err)
    os.close(fd)
    os.unlink(name)
    return None


def json_safe(obj: Any) -> Any:
    """``obj`` with every NaN / ±inf float replaced by None (JSON has no NaN: ``null``), recursively."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def folder_problem(path: str | Path) -> str | None:
    """Why ``path`` cannot be, or be created as, a folder that files are written into (a dangling
    link on the way, a file, a folder no file can be created in), or None when it can."""
    probe = nearest_existing(path)
    if link := dangling_link(probe):
        return link
    if not probe.is_dir():
        return "exists and is not a directory" if probe == Path(path) else f"{probe} is not a directory"
    why = cannot_create_in(probe)
    return None if why is None else f"no file can be created in {probe} ({why})"


def _umask() -> int:
    """The process umask (read once: reading it means setting it, which is process-wide)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def plain_mode(*paths: str | Path) -> None:
    """Give files the mode a plain ``open`` would (0666 less the umask), as the project's atomic writes
    do: safetensors writes through a 0600 temp file, which would leave the weights unreadable to the
    group while every other file of the folder is not."""
    for p in paths:
        try:
            os.chmod(p, 0o666 & ~_umask())
        except FileNotFoundError:
            pass


def atomic_write_json(path: str | Path, obj: Any, *, indent: int = 2, sort_keys: bool = True) -> None:
    """Atomically write ``obj`` as JSON (NaN/inf written as such, like ``json.dumps``)."""
    atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=sort_keys) + "\n")


def new_figure(nrows: int = 1, ncols: int = 1, **kwargs: Any) -> tuple[Any, Any]:
    """A matplotlib ``Figure`` on its own Agg canvas and its axes (``Figure.subplots``): pyplot's backend,
    a notebook's inline one included, is left as it is (``matplotlib.use("Agg", force=True)`` switched
    the caller's session to Agg)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(**kwargs)
    FigureCanvasAgg(fig)
    return fig, fig.subplots(nrows, ncols)


def save_figure(fig: Any, path: str | Path) -> Path:
    """Lay out a matplotlib ``fig``, write it to ``path`` whole or not at all (parents created; a failed
    write, e.g. a full disk, keeps the previous figure: it was truncated in place), close it; returns
    the path. The format is the suffix's (matplotlib's default without one)."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fmt = path.suffix[1:].lower() or plt.rcParams["savefig.format"]
    try:
        fig.tight_layout()
        atomic_write_file(path, lambda tmp: fig.savefig(tmp, format=fmt))
    finally:
        plt.close(fig)
    return path


def describe_os_error(err: OSError) -> str:
    """``no space left on device (ENOSPC, /path/file)``: the OS error in words, its code and file."""
    code = errno.errorcode.get(err.errno, "") if err.errno else ""
    words = (err.strerror or (os.strerror(err.errno) if err.errno else str(err)) or type(err).__name__)
    where = ", ".join(str(x) for x in (code, err.filename) if x)
    limit = ""
    if err.errno == errno.EFBIG:  # the file-size limit, not the disk: say which (a write without a file
        import resource  # name, e.g. shared memory in /dev/shm, named none and read as a full disk)

        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if soft != resource.RLIM_INFINITY:
            limit = f"; the file-size limit (ulimit -f) is {soft // 1024:,} KiB"
    return f"{words[:1].lower()}{words[1:]}" + (f" ({where})" if where else "") + limit


_NO_SPACE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_NO_SPACE_WORDS = ("No space left on device", "Disk quota exceeded", "File too large", "os error 28")


def storage_full(err: BaseException) -> str | None:
    """One line when ``err`` (or what it was raised from) is a write that storage refused: a full
    disk, a quota or the file-size limit (``ulimit -f``), also as torch's zip writer and safetensors
    report them (without an errno); None for any other error (a bug keeps its traceback)."""
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _NO_SPACE_ERRNOS:
            return describe_os_error(e)
        first = (str(e).strip().splitlines() or [""])[0][:300]
        if any(w in str(e) for w in _NO_SPACE_WORDS):
            return first
        if "inline_container" in str(e) or "unexpected pos" in str(e):
            return f"a file write failed ({first}): the disk is probably full, or the file-size limit (ulimit -f) reached"
        # what it was raised from; what it was raised *during* only for an OSError (an OS error while
        # handling another): a bug in an `except OSError` handler keeps its traceback
        e = e.__cause__ or (e.__context__ if isinstance(e, OSError) else None)
    return None


def report_storage_full(err: BaseException, prog: str | None = None) -> int:
    """For a command's top level: print ``[PROG: ]error[ (rank N)]: <storage_full line>; ...`` and
    return exit status 1 when ``err`` is a write that storage refused; re-raise ``err`` otherwise."""
    line = storage_full(err)
    if line is None:
        raise err
    rank = os.environ.get("RANK")
    head = f"{prog}: error" if prog else "error"
    print(f"{head}{f' (rank {rank})' if rank else ''}: {line}; files this command finished before are kept; "
          "free space (or raise the limit) and rerun it", file=sys.stderr)
    return 1
