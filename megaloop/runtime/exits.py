"""Exit statuses shared by the trainer and the launchers that restart it (no heavy imports)."""

EXIT_OK = 0
EXIT_USAGE = 2  # bad input: a config field, file, checkpoint or data (one line names it)
EXIT_REQUEUE = 75  # stopped by SIGTERM/SIGUSR1 after writing a checkpoint: requeue / resume the run
EXIT_INTERRUPTED = 130  # stopped by Ctrl-C (SIGINT) after writing a checkpoint (not requeued)

# the signals the trainer turns into "checkpoint, then stop" that a helper process would die of
STOP_SIGNALS_UNHANDLED_BY_HELPERS = ("SIGUSR1", "SIGUSR2", "SIGHUP")


def shield_resource_tracker() -> None:
    """Start Python's ``multiprocessing`` resource tracker (the data loader's shared memory is
    registered with it) with SIGUSR1, SIGUSR2 and SIGHUP blocked, a mask it inherits. It ignores
    SIGINT and SIGTERM itself but dies of SIGUSR1, the slurm pre-emption signal, when that is sent
    to the whole process group: Python then relaunches it, warns and prints a KeyError traceback per
    shared-memory segment, and the segments can leak. No-op where it already runs."""
    import signal
    from multiprocessing import resource_tracker

    if not hasattr(signal, "pthread_sigmask"):
        return
    block = {getattr(signal, n) for n in STOP_SIGNALS_UNHANDLED_BY_HELPERS if hasattr(signal, n)}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, block)
    try:
        resource_tracker.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
