"""A fork worker pool for data preparation that stops cleanly after an error, an interrupt or a
worker's death.

Built on :class:`concurrent.futures.ProcessPoolExecutor`, not ``multiprocessing.Pool``:

- ``Pool.terminate`` SIGTERMs workers while its task-handler thread may still have to send a sentinel
  on the result queue; a worker killed mid-send dies holding that queue's lock and ``terminate``
  waits forever (seen in CI: a bad input file made the converter hang instead of exiting 2).
- A ``Pool`` worker killed by the OS (the out-of-memory killer, a ``kill -9``) is replaced without a
  word and its task never returns; killed while idle, it also dies holding the task queue's read
  lock, after which the pool hands out nothing and even ``terminate`` blocks (the converter hung).

The executor notices a dead worker, marks the pool broken and fails every pending task, which
:class:`ForkPool` reports as :class:`WorkerDied` naming the signal and the tasks that were running.
At most one task per worker is out at a time, so after a task's error the running tasks (each one
input file) finish and nothing new starts; an interrupt (Ctrl-C, SIGTERM raised as
``KeyboardInterrupt``) kills the workers at once.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Iterable, Iterator

from megaloop.data.errors import DataError

__all__ = ["ForkPool", "WorkerDied"]


class WorkerDied(DataError):
    """A pool worker died (killed by a signal, or its initializer failed) while tasks were out."""


class ForkPool:
    """``with ForkPool(n, init, args) as pool: for r in pool.imap(fn, tasks): ...``

    ``imap`` yields ``fn(task)`` per task (in task order when ``ordered``), with at most ``n`` tasks
    submitted at a time. The first exception a task raises is re-raised in the caller once the tasks
    still running have finished."""

    def __init__(self, workers: int, initializer: Callable[..., None] | None = None,
                 initargs: tuple = ()) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.workers = workers
        self._ex = ProcessPoolExecutor(workers, mp_context=mp.get_context("fork"), initializer=initializer,
                                       initargs=initargs)
        self._running: dict[Future, tuple[int, Any]] = {}  # future -> (index, task)
        self._procs: dict[int, Any] = {}  # pid -> Process: every worker seen, for exit codes and kills
        self._stray: set = set()  # children an interrupted submit forked (maybe not in the executor's table)
        self.describe: Callable[[Any], str] = str

    @property
    def _inflight(self) -> int:
        return len(self._running)

    def worker_pids(self) -> list[int]:
        self._seen()
        return sorted(self._procs)

    def _seen(self) -> None:
        self._procs.update(getattr(self._ex, "_processes", None) or {})  # the executor's own table

    def _submit(self, fn: Callable[[Any], Any], index: int, task: Any) -> None:
        before = set(mp.active_children())
        try:
            fut = self._ex.submit(fn, task)
        except BrokenProcessPool as exc:  # a death noticed between a result and this submit
            raise WorkerDied(self._death_message(exc)) from None
        except BaseException:  # an interrupt inside submit: workers it forked may be unrecorded
            self._stray |= set(mp.active_children()) - before
            raise
        self._running[fut] = (index, task)
        self._seen()

    def _next_done(self) -> tuple[int, bool, Any]:
        """``(index, ok, result or exception)`` of a finished task (the lowest index among those
        that finished together); :class:`WorkerDied` when the pool broke."""
        done, _ = wait(list(self._running), return_when=FIRST_COMPLETED)
        fut = min(done, key=lambda f: self._running[f][0])
        exc = fut.exception()
        if isinstance(exc, BrokenProcessPool):
            raise WorkerDied(self._death_message(exc)) from None
        index, _ = self._running.pop(fut)
        return (index, True, fut.result()) if exc is None else (index, False, exc)

    def _death_message(self, exc: BaseException) -> str:
        tasks = ", ".join(self.describe(t) for _, t in sorted(self._running.values(), key=lambda it: it[0]))
        self._running.clear()  # the executor failed them all
        self._ex.shutdown(wait=True, cancel_futures=True)  # its workers are reaped: their exit codes are known
        codes = [p.exitcode for p in self._procs.values() if p.exitcode not in (None, 0, -signal.SIGTERM)]
        how = ", ".join(f"killed by {signal.Signals(-c).name}" if c < 0 and -c in signal.valid_signals()
                        else f"exit status {c}" for c in codes) or str(exc)
        if -signal.SIGKILL in codes or -signal.SIGABRT in codes:  # the OOM killer; a failed allocation aborts
            hint = ("SIGKILL is what the kernel's out-of-memory killer sends, SIGABRT often what a failed "
                    "allocation (the tokenizer's) raises: rerun (what finished is kept) with fewer --workers or more memory; "
                    "a file needs several times its size, a long document ~200 bytes per character")
        else:
            hint = "rerun (what finished is kept)"
        doing = f" while working on one of: {tasks}" if tasks else ""
        return f"a worker process died ({how}){doing}; {hint}"

    def imap(self, fn: Callable[[Any], Any], tasks: Iterable[Any], ordered: bool = True,
             describe: Callable[[Any], str] = str) -> Iterator[Any]:
        """``describe(task)``: how an error names a task (default ``str``)."""
        self.describe = describe
        pending = enumerate(tasks)
        for index, task in pending:
            self._submit(fn, index, task)
            if self._inflight >= self.workers:
                break
        held: dict[int, Any] = {}
        want = 0
        while self._inflight:
            index, ok, result = self._next_done()
            if not ok:
                raise result
            nxt = next(pending, None)
            if nxt is not None:
                self._submit(fn, *nxt)
            if not ordered:
                yield result
                continue
            held[index] = result
            while want in held:
                yield held.pop(want)
                want += 1

    def _kill(self) -> None:
        """Stop now: kill every worker (the executor then fails what was out) and shut down.

        An interrupt can land inside ``submit`` while the executor starts: after a worker was forked
        but before the executor recorded it, or before its manager thread started (whose ``join`` in
        ``shutdown`` then raises ``RuntimeError``). Every worker of this pool (the executor's table, and
        the children that appeared during an interrupted ``submit``) is therefore killed and reaped
        here, recorded or not, so none is left for the interpreter's exit to wait on; other children
        are left alone."""
        self._seen()
        ours = {*self._procs.values(), *self._stray}
        for p in ours:
            if p.exitcode is None:
                p.kill()
        try:
            self._ex.shutdown(wait=True, cancel_futures=True)
        except RuntimeError:  # "cannot join thread before it is started": nothing of it to wait for
            pass
        for p in ours:
            p.join()

    def __enter__(self) -> ForkPool:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and not issubclass(exc_type, Exception):
            self._kill()  # an interrupt: stop now
            return
        try:
            wait(list(self._running))  # let the running tasks finish; their results are not needed
        except BaseException:  # interrupted while waiting
            self._kill()
            raise
        self._running.clear()
        self._ex.shutdown(wait=True)
