"""Standard output that a closed pipe does not stop: ``megaloop train ... | head`` trains on.

When the reader of the command's stdout exits (``head``, a closed ``tee``, a log shipper that
died), the next ``print`` raises ``BrokenPipeError``. In a training loop that was a traceback, exit 1
and no checkpoint: the steps since the last save were lost and slurm saw a failure, not a requeue.
:func:`guard_stdout` wraps ``sys.stdout`` so that the first broken write points fd 1 at
``/dev/null``, says so once on stderr, and the command goes on (every command also writes what it
computes to files: a run's ``metrics.jsonl``, ``--json-out``, the output folders).
"""

from __future__ import annotations

import os
import sys

NOTE = ("megaloop: standard output was closed (the reader of its pipe exited); console output is off "
        "from here, the command goes on (a run's metrics.jsonl keeps every step)")


class PipeSafeStdout:
    """A text stream that delegates to ``stream`` until a write or flush raises ``BrokenPipeError``
    (``note``: say so on stderr; off for stderr itself, e.g. ``2>&1 | head``)."""

    def __init__(self, stream, note: bool = True) -> None:
        self._stream = stream
        self._note = note
        self.lost = False

    def _gone(self) -> None:
        self.lost = True
        try:  # what is still buffered, and every later write, goes to /dev/null instead
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        except (OSError, ValueError):
            pass
        if self._note:
            try:
                print(NOTE, file=sys.stderr, flush=True)
            except OSError:
                pass

    def write(self, text: str) -> int:
        if self.lost:
            return len(text)
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._gone()
            return len(text)

    def flush(self) -> None:
        if self.lost:
            return
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._gone()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def guard_stdout() -> None:
    """Wrap ``sys.stdout`` and ``sys.stderr`` once (idempotent; a stream that is None or already
    wrapped is left). stderr too: with ``2>&1 | head`` it is the same closed pipe, and the one-line
    messages of a stop (``interrupted``, a non-finite loss) would raise there."""
    if sys.stdout is not None and not isinstance(sys.stdout, PipeSafeStdout):
        sys.stdout = PipeSafeStdout(sys.stdout)
    if sys.stderr is not None and not isinstance(sys.stderr, PipeSafeStdout):
        sys.stderr = PipeSafeStdout(sys.stderr, note=False)
