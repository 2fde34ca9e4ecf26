"""Helpers of :mod:`megaloop.train.checkpoint` around megatron's checkpoint writer: collective
agreement, the writer's results queue kept in-process, and one-line descriptions of failed saves."""

from __future__ import annotations

import logging
import os
import queue
import re
from contextlib import contextmanager

import torch

from megaloop.runtime.files import describe_os_error


def agree(ok: bool) -> bool:
    """True on every rank iff ``ok`` on every rank (one all-reduce; no-op without a process group)."""
    if not torch.distributed.is_initialized():
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    if torch.distributed.get_backend() == "nccl":
        flag = flag.cuda()
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return bool(flag.item())


@contextmanager
def in_process_write_queue():
    """Keep megatron's ``torch_dist`` writer from starting a ``multiprocessing.Manager``.

    megatron-core 0.16.1's ``FileSystemWriterAsync`` collects its write results through
    ``filesystem_async._get_write_results_queue()``: a queue of a *spawned* Manager process started
    at the first save and kept for the life of the trainer. That process shares the trainer's
    process group and has default signal handling, so a SIGTERM/SIGUSR1 sent to the whole group
    (torchrun, slurm, ``timeout``, ``kill -- -PGID``) kills it and the stop checkpoint then fails
    with BrokenPipeError. Our saves are synchronous (``dist_checkpointing.save`` without
    ``async_sharded_save`` runs the write function in this process: ``AsyncRequest.execute_sync``),
    so the results queue is only ever used within this process and a plain ``queue.Queue`` serves.
    No extra process, nothing for a group signal to kill, and no spawn at the first save."""
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async as fsa
    except ImportError:  # another megatron layout: nothing to patch
        yield
        return
    orig = getattr(fsa, "_get_write_results_queue", None)
    if orig is None:
        yield
        return
    results: queue.Queue = queue.Queue()
    fsa._get_write_results_queue = lambda: results
    # its "Local process N encountered an error" line would precede the one line that the caller
    # reports for the same failure (checkpoint.CheckpointManager._save_failed)
    log = logging.getLogger(fsa.__name__)
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        fsa._get_write_results_queue = orig
        log.setLevel(level)


def _chain(err: BaseException | None):
    """``err``, the per-rank exceptions of torch's ``CheckpointException`` (``failures``; each may
    be wrapped in a ``_WrappedException`` ``.exc`` or an (exception, traceback) tuple), and causes."""
    seen: set[int] = set()
    todo = [err]
    while todo:
        e = todo.pop(0)
        if isinstance(e, tuple) and e and isinstance(e[0], BaseException):
            e = e[0]
        if not isinstance(e, BaseException) and hasattr(e, "exc"):
            e = e.exc
            if isinstance(e, tuple) and e and isinstance(e[0], BaseException):
                e = e[0]
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo.extend(failures.values())
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)


_ERRNO_TEXT = re.compile(r"\[Errno (\d+)\] ([^:'\"]+)(?::\s*'([^']*)')?")


def os_error_of(err: BaseException) -> OSError | None:
    """The OSError behind a failed save (raised here, or in megatron's writer processes), if any;
    one known only by its text (a writer's exception gathered from another rank loses its cause)
    is rebuilt from ``[Errno N] words: 'file'``."""
    chain = list(_chain(err))
    found = next((e for e in chain if isinstance(e, OSError)), None)
    if found is not None:
        return found
    for e in chain:
        m = _ERRNO_TEXT.search(str(e))
        if m:
            return OSError(int(m.group(1)), m.group(2).strip(), *([m.group(3)] if m.group(3) else []))
    return None


LOW_SPACE = 16 * 2**20  # bytes free at a failed write below which the disk counts as full


def _free_bytes(where) -> int | None:
    try:
        st = os.statvfs(where)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _first_failure(err: BaseException) -> str:
    """``Type: first line`` of the innermost useful exception (not torch's per-rank container)."""
    inner = [e for e in _chain(err) if not isinstance(getattr(e, "failures", None), dict)]
    e = inner[0] if inner else err
    text = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def explain_save_failure(err: BaseException, where) -> str | None:
    """One line for a save that failed on the filesystem, ``None`` for another failure (a bug).

    An OSError (raised here or in a writer process) is named with its code and file. torch writes
    ``*.distcp`` and ``common.pt`` through its zip writer, which reports a full disk only as
    ``RuntimeError: [enforce fail at inline_container.cc] . unexpected pos N vs M`` (no errno), so
    a failed write on a filesystem left (nearly) without free space is reported as
    ``no space left on device`` with the free space; any other failure of megatron's write phase
    (torch's ``CheckpointException``) by its first line. Call before removing the partial files."""
    os_err = os_error_of(err)
    if os_err is not None:
        return describe_os_error(os_err)
    free = _free_bytes(where)
    writing = any(type(e).__name__ == "CheckpointException" or "Worker failure" in str(e) or
                  "inline_container" in str(e) for e in _chain(err))
    if writing and free is not None and free < LOW_SPACE:
        return (f"no space left on device ({free / 2**20:.1f} MiB free on that filesystem; "
                f"the writer reported {_first_failure(err)})")
    if writing and _received_from_coordinator(err):
        return "the write failed on a rank; the error is named on rank 0, which gathered the ranks' results"
    if writing:
        zip_write = any("inline_container" in str(e) or "unexpected pos" in str(e) for e in _chain(err))
        return f"the write failed: {_first_failure(err)}{_size_limit_hint() if zip_write else ''}"
    return None


def _size_limit_hint() -> str:
    """Why a zip write failed without an errno, when this process cannot write large files: its
    file-size limit (``ulimit -f``; a file past it fails with EFBIG, which torch's writer drops)."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if soft == resource.RLIM_INFINITY:
        return " (torch's writer does not name the OS error; a disk quota reads this way too)"
    return (f" (this process's file-size limit, `ulimit -f`, is {soft / 2**20:.1f} MiB: a checkpoint "
            "file larger than that cannot be written)")


def _received_from_coordinator(err: BaseException) -> bool:
    """torch's ``CheckpointException`` as a non-coordinator rank receives it: the coordinator's
    verdict broadcast without the per-rank failures (``failures`` empty), so nothing to name here."""
    return (torch.distributed.is_initialized() and torch.distributed.get_rank() != 0
            and type(err).__name__ == "CheckpointException" and not getattr(err, "failures", None))
