"""A fork worker pool for data preparation that stops without ``Pool.terminate``'s deadlock.

``multiprocessing.Pool.terminate`` SIGTERMs its workers while its task-handler thread may still have
to send a sentinel on the result queue; a worker killed in the middle of sending a result dies holding
that queue's write lock and ``terminate`` then waits forever (seen in CI: a bad input file made the
converter hang instead of exiting 2). :class:`ForkPool` keeps at most one task per worker in flight,
so after an error it waits for the running tasks (each one input file) and ends the pool with
``close``/``join``, which never kills a worker mid-send. Only an interrupt (Ctrl-C, or SIGTERM raised as
``KeyboardInterrupt``) still uses ``terminate``, so that it stops at once.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
from typing import Any, Callable, Iterable, Iterator

__all__ = ["ForkPool"]


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
        self._pool = mp.get_context("fork").Pool(workers, initializer, initargs)
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._inflight = 0

    def _submit(self, fn: Callable[[Any], Any], index: int, task: Any) -> None:
        done = self._done
        self._pool.apply_async(fn, (task,), callback=lambda r: done.put((index, True, r)),
                               error_callback=lambda e: done.put((index, False, e)))
        self._inflight += 1

    def _next_done(self) -> tuple[int, bool, Any]:
        item = self._done.get()
        self._inflight -= 1
        return item

    def imap(self, fn: Callable[[Any], Any], tasks: Iterable[Any], ordered: bool = True) -> Iterator[Any]:
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

    def __enter__(self) -> ForkPool:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and not issubclass(exc_type, Exception):
            self._pool.terminate()  # an interrupt: stop now
        else:
            try:
                while self._inflight:  # let the running tasks finish; their results are not needed
                    self._next_done()
            except BaseException:  # interrupted while waiting
                self._pool.terminate()
                self._pool.join()
                raise
            self._pool.close()
        self._pool.join()
