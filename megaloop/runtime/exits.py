"""Exit statuses shared by the trainer and the launchers that restart it (no heavy imports)."""

EXIT_OK = 0
EXIT_USAGE = 2  # bad input: a config field, file, checkpoint or data (one line names it)
EXIT_REQUEUE = 75  # stopped by SIGTERM/SIGUSR1 after writing a checkpoint: requeue / resume the run
EXIT_INTERRUPTED = 130  # stopped by Ctrl-C (SIGINT) after writing a checkpoint (not requeued)
