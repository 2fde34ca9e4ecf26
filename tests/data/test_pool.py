"""ForkPool: the data-prep worker pool that stops after an error without ``Pool.terminate``."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from megaloop.data._pool import ForkPool

_MARKS: Path | None = None


def _work(i: int) -> int:
    assert _MARKS is not None
    (_MARKS / f"started_{i}").touch()
    if i == 1:
        raise ValueError("task 1 is bad")
    time.sleep(0.05 * (3 - i % 3))  # finish out of order
    (_MARKS / f"finished_{i}").touch()
    return i * i


def _marks(kind: str) -> set[int]:
    assert _MARKS is not None
    return {int(p.name.split("_")[1]) for p in _MARKS.glob(f"{kind}_*")}


@pytest.fixture(autouse=True)
def marks(tmp_path):
    global _MARKS
    _MARKS = tmp_path
    yield tmp_path
    _MARKS = None


def test_results_come_in_task_order_or_as_they_finish():
    tasks = [0, 2, 3, 4, 5, 6, 7]
    with ForkPool(3) as pool:
        assert list(pool.imap(_work, tasks)) == [t * t for t in tasks]
    with ForkPool(3) as pool:
        got = list(pool.imap(_work, tasks, ordered=False))
    assert sorted(got) == sorted(t * t for t in tasks)


def test_an_error_stops_dispatch_and_the_running_tasks_finish_before_it_is_raised():
    # The old code (imap_unordered + terminate) queued every task at once and killed workers that
    # might be sending a result; here at most `workers` tasks were ever handed out, the one still
    # running when task 1 failed completes, and nothing after it starts.
    with pytest.raises(ValueError, match="task 1 is bad"):
        with ForkPool(2) as pool:
            for _ in pool.imap(_work, range(40)):
                pass
    started = _marks("started")
    assert 1 in started and len(started) <= 4, started
    assert _marks("finished") == started - {1}
    assert not pool._inflight


def test_an_error_in_the_callers_loop_also_drains_the_pool():
    with pytest.raises(RuntimeError, match="caller"):
        with ForkPool(2) as pool:
            for r in pool.imap(_work, [0, 2, 3, 4, 5, 6]):
                raise RuntimeError("caller")
    assert _marks("finished") == _marks("started")
    assert not pool._inflight


def _sleep_forever(i: int) -> int:
    time.sleep(600)
    return i


def test_an_interrupt_terminates_the_workers_at_once():
    pids: list[int] = []

    def interrupt(signum, frame):  # noqa: ARG001
        if pool._inflight < 2:  # not both submitted yet (a loaded machine): the Ctrl-C is meant for the wait
            signal.setitimer(signal.ITIMER_REAL, 0.2)
            return
        pids.extend(pool.worker_pids())
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    t0 = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            with ForkPool(2) as pool:
                signal.setitimer(signal.ITIMER_REAL, 0.5)
                for _ in pool.imap(_sleep_forever, range(4)):
                    pass
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert time.monotonic() - t0 < 60
    assert len(pids) == 2
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_an_interrupt_leaves_children_that_are_not_the_pools_alone():
    """Only this pool's workers are killed: a child someone else started meanwhile lives on."""
    import multiprocessing as mp

    other = mp.get_context("fork").Process(target=_sleep_forever, args=(0,))
    try:
        with pytest.raises(KeyboardInterrupt):
            with ForkPool(2) as pool:
                for _ in pool.imap(abs, range(4)):
                    other.start()
                    raise KeyboardInterrupt
        assert other.is_alive()
    finally:
        if other.pid is not None:
            other.kill()
            other.join()


def _interrupted_start_leaves_no_child() -> None:
    """A pool whose start is interrupted (as patched by the caller) stops at once and leaves no child."""
    import multiprocessing as mp

    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        with ForkPool(2) as pool:
            for _ in pool.imap(_sleep_forever, range(4)):
                pass
    assert time.monotonic() - t0 < 30
    left = mp.active_children()  # also reaps the finished ones
    assert not left, f"children left running: {left}"


def test_an_interrupt_while_the_executor_starts_leaves_no_worker(monkeypatch):
    """Ctrl-C inside ``submit``: the workers are forked but the executor's manager thread has not
    started. Stopping used to raise ``RuntimeError: cannot join thread before it is started`` over
    the interrupt and left the workers for the interpreter's exit to wait on."""
    from concurrent.futures import process

    def interrupted_start(self):  # noqa: ARG001
        raise KeyboardInterrupt

    monkeypatch.setattr(process._ExecutorManagerThread, "start", interrupted_start)
    _interrupted_start_leaves_no_child()


def test_an_interrupt_before_the_executor_records_a_worker_kills_it(monkeypatch):
    """Ctrl-C between a worker's fork and the executor recording it: that worker is killed too."""
    from concurrent.futures import process

    def spawn_then_interrupt(self):
        p = self._mp_context.Process(target=_sleep_forever, args=(0,))
        p.start()
        raise KeyboardInterrupt  # before ``self._processes[p.pid] = p``

    monkeypatch.setattr(process.ProcessPoolExecutor, "_spawn_process", spawn_then_interrupt)
    _interrupted_start_leaves_no_child()


def test_workers_must_be_positive():
    with pytest.raises(ValueError, match="workers must be >= 1"):
        ForkPool(0)


def _killed_at_two(i: int) -> int:
    (_MARKS / f"started_{i}").touch()
    if i == 2:
        os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's out-of-memory killer does
    time.sleep(0.3)
    (_MARKS / f"finished_{i}").touch()
    return i


def test_a_worker_killed_by_the_os_is_an_error_naming_the_task_not_a_hang():
    # multiprocessing.Pool replaces a dead worker silently and its task never returns: the
    # converter waited forever. Now the death is named (signal, the tasks that were running).
    from megaloop.data._pool import WorkerDied

    t0 = time.monotonic()
    with pytest.raises(WorkerDied, match=r"\(killed by SIGKILL\) while working on one of: .*task-2"):
        with ForkPool(2) as pool:
            for _ in pool.imap(_killed_at_two, range(8), describe=lambda i: f"task-{i}"):
                pass
    assert time.monotonic() - t0 < 60
    # dispatch stopped at the death; the other worker's task may be cut short (the pool is broken)
    assert _marks("finished") <= _marks("started") - {2}
    assert len(_marks("started")) <= 5


def _aborted(i: int) -> int:
    if i == 1:
        import faulthandler

        faulthandler.disable()  # pytest's handler would print this worker's stack and module list
        os.kill(os.getpid(), signal.SIGABRT)  # as a failed allocation in the tokenizer's Rust code does
    time.sleep(0.3)
    return i


def test_an_aborted_worker_is_named_with_the_memory_hint():
    # `memory allocation of N bytes failed` aborts the worker; the line said only "rerun", which fails again
    from megaloop.data._pool import WorkerDied

    with pytest.raises(WorkerDied, match=r"\(killed by SIGABRT\) while working on one of: .*task-1.*failed "
                                         r"allocation.*fewer --workers or more memory"):
        with ForkPool(2) as pool:
            for _ in pool.imap(_aborted, range(4), describe=lambda i: f"task-{i}"):
                pass


def test_a_death_seen_when_submitting_is_also_worker_died(monkeypatch):
    # the executor may notice a dead worker between delivering a result and the next submit, which then
    # raises BrokenProcessPool itself: a traceback (exit 1) in place of the one line (reviewer, 3 of 30)
    from concurrent.futures.process import BrokenProcessPool

    from megaloop.data._pool import WorkerDied

    with pytest.raises(WorkerDied, match="a worker process died"):
        with ForkPool(1) as pool:
            def broken(*a, **k):
                raise BrokenProcessPool("A child process terminated abruptly")
            monkeypatch.setattr(pool._ex, "submit", broken)
            list(pool.imap(_work, [0, 2]))
