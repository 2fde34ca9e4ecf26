"""Exit statuses shared by the trainer and the launchers that restart it (no heavy imports)."""

EXIT_OK = 0
EXIT_USAGE = 2  # bad input: a config field, file, checkpoint or data (one line names it)
EXIT_REQUEUE = 75  # stopped by SIGTERM/SIGUSR1 after writing a checkpoint: requeue / resume the run
EXIT_INTERRUPTED = 130  # stopped by Ctrl-C (SIGINT) after writing a checkpoint (not requeued)

# the signals the trainer turns into "checkpoint, then stop" that a helper process would die of
STOP_SIGNALS_UNHANDLED_BY_HELPERS = ("SIGUSR1", "SIGUSR2", "SIGHUP")


def start_shielded(start, names=("SIGTERM", *STOP_SIGNALS_UNHANDLED_BY_HELPERS)):
    """``start()`` with ``names`` blocked in this thread, so that the processes it forks inherit them
    blocked (the parent's pending ones are delivered when the mask is restored). A DataLoader's
    workers (``start = lambda: iter(loader)``) then survive the stop signal that torchrun, slurm or
    ``kill -- -PGID`` sends to the whole process group: they died of it, and the trainer, about to
    checkpoint, failed with "DataLoader worker (pid N) is killed by signal: Terminated" (exit 1, no
    checkpoint). The trainer stops them as usual (a sentinel, then a join); a worker whose trainer
    is gone exits by itself (torch's watchdog). SIGINT is left alone: torch's workers ignore it.
    Also used to make two writes one for a stop signal (``reproduce``'s results.json and report)."""
    import signal

    if not hasattr(signal, "pthread_sigmask"):
        return start()
    block = {getattr(signal, n) for n in names if hasattr(signal, n)}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, block)
    try:
        return start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def shield_resource_tracker() -> None:
    """Start Python's ``multiprocessing`` resource tracker (the data loader's shared memory is
    registered with it) with SIGUSR1, SIGUSR2 and SIGHUP blocked, a mask it inherits. It ignores
    SIGINT and SIGTERM itself but dies of SIGUSR1, the slurm pre-emption signal, when that is sent
    to the whole process group: Python then relaunches it, warns and prints a KeyError traceback per
    shared-memory segment, and the segments can leak. No-op where it already runs."""
    from multiprocessing import resource_tracker

    start_shielded(resource_tracker.ensure_running, STOP_SIGNALS_UNHANDLED_BY_HELPERS)
