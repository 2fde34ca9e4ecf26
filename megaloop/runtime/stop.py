"""Graceful stop on signals for the training loops: ``megaloop train``
(:meth:`megaloop.train.trainer.Trainer.run`), ``megaloop rl`` and ``megaloop distill-prefill``.

While a :class:`SignalStop` is entered, SIGTERM, SIGUSR1 (slurm's ``--signal=B:USR1@120`` warning,
forwarded by torchrun) and SIGINT only set a flag; the loop calls :meth:`SignalStop.agreed` at each
step boundary but the last, where every rank learns whether *some* rank received one (an all-reduce
over torch.distributed's default group when it is initialised: all ranks take the same decision,
as they must around ZeRO's collectives). On a signal the loop writes a checkpoint through its
ordinary save path (checkpoint + sidecar; metrics.jsonl is flushed each step) and stops; the
command prints one line (:func:`stop_line`) and exits :func:`exit_code`: 75 (``EXIT_REQUEUE``,
SIGTERM/SIGUSR1: resume me; slurm/common.sh requeues on it) or 130 (``EXIT_INTERRUPTED``, Ctrl-C).
A second Ctrl-C raises :class:`KeyboardInterrupt` at once (no checkpoint). A signal during the last
step (or the final writes) lets the run complete: it exits 0. The previous handlers come back on exit.

The one-shot data-preparation tools use :func:`sigterm_raises` instead: SIGTERM raises
:class:`Terminated` (a ``KeyboardInterrupt``), so their interrupt path cleans up; exit 143.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from pathlib import Path

from megaloop.runtime.exits import EXIT_INTERRUPTED, EXIT_REQUEUE

HANDLED = ("SIGTERM", "SIGUSR1", "SIGINT")
# the value each signal has in the all-reduce (MAX wins: Ctrl-C over SIGUSR1 over SIGTERM)
_RANK = {"SIGTERM": 1, "SIGUSR1": 2, "SIGINT": 3}


def _signals() -> list[int]:
    return [int(getattr(signal, n)) for n in HANDLED if hasattr(signal, n)]


class SignalStop:
    """Context manager: SIGTERM/SIGUSR1/SIGINT set :attr:`received` instead of stopping the process.

    ``lead``: this process prints the notice of a first Ctrl-C (rank 0). Outside the main thread
    (where Python cannot install handlers) nothing is installed; :meth:`agreed` still takes part in
    the all-reduce, so the ranks stay in step."""

    def __init__(self, lead: bool = True):
        self.lead = lead
        self.received: int | None = None  # the first signal this process received (Ctrl-C overrides)
        self._old: dict[int, object] = {}

    def __enter__(self) -> "SignalStop":
        if threading.current_thread() is threading.main_thread():
            from megaloop.runtime.setup_stop import loop_entered

            loop_entered()  # the set-up handler this replaces acts as the default once put back
            for s in _signals():
                self._old[s] = signal.signal(s, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}

    def _on_signal(self, signum: int, _frame) -> None:
        if signum == signal.SIGINT:
            if self.received == signal.SIGINT:  # a second Ctrl-C: stop now, without saving
                signal.signal(signal.SIGINT, signal.default_int_handler)
                raise KeyboardInterrupt
            if self.lead:  # os.write: no buffered-writer re-entry if the signal lands inside a print
                os.write(2, b"\ninterrupted: checkpointing after the current step, then exiting "
                            b"(Ctrl-C again to stop at once without saving)\n")
            self.received = signum
        elif self.received is None:
            self.received = signum

    def agreed(self) -> int:
        """The signal some rank received (0 if none; SIGINT over SIGUSR1 over SIGTERM); collective
        when torch.distributed is initialised: every rank must call it at the same step."""
        name = signal.Signals(self.received).name if self.received else None
        mine = _RANK.get(name, 0)
        import torch

        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            from megaloop.runtime.parallel import comm_device

            flag = torch.tensor([mine], dtype=torch.int32, device=comm_device())
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            mine = int(flag.item())
        if not mine:
            return 0
        return int(getattr(signal, next(n for n, v in _RANK.items() if v == mine)))


def exit_code(sig: int) -> int:
    """130 (``EXIT_INTERRUPTED``) after Ctrl-C, else 75 (``EXIT_REQUEUE``: resume / requeue me)."""
    return EXIT_INTERRUPTED if sig == signal.SIGINT else EXIT_REQUEUE


def stop_line(prog: str, sig: int, step: int, checkpoint: str | Path | None) -> str:
    """The one line of a signal stop: what stopped the run, at which step, the checkpoint written
    (``None``: none was) and how to continue."""
    what = "interrupted (Ctrl-C)" if sig == signal.SIGINT else f"stopped by {signal.Signals(sig).name}"
    code = exit_code(sig)
    if checkpoint is None:
        return f"{prog}: {what} at step {step}; no checkpoint was written (exit {code})"
    return f"{prog}: {what} at step {step}: checkpoint {checkpoint} written; continue with --resume (exit {code})"


class Terminated(KeyboardInterrupt):
    """SIGTERM inside :func:`sigterm_raises`: raised like Ctrl-C, so a command's interrupt path (worker
    pools stopped, temporary files removed, one line) runs for it too; exit 143 (128 + SIGTERM)."""


@contextlib.contextmanager
def sigterm_raises():
    """For the one-shot tools (data preparation): SIGTERM (slurm, ``timeout``) raises :class:`Terminated`
    in the main thread instead of killing the process at once, without a word or its clean-up. A
    process forked inside (a worker that has not reset the handler yet) just ends. The previous
    handler comes back on exit; off the main thread (signals cannot be set there) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    main_pid = os.getpid()

    def on_sigterm(signum, frame):  # noqa: ARG001
        if os.getpid() != main_pid:
            os._exit(128 + signum)
        raise Terminated

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


@contextlib.contextmanager
def sigterm_default():
    """Inside :func:`sigterm_raises`: SIGTERM ends the process at once again, for a call into native code
    that does not return to Python for minutes (the tokenizers library's BPE merges), where a Python
    handler would wait for it to finish; callers leave nothing there a later run cannot clean up."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def run_interruptible(main, argv, prog: str) -> int:
    """``main(argv)`` inside :func:`sigterm_raises`: an interrupt that escapes it (Ctrl-C or SIGTERM during
    its imports and argument checks, before its own interrupt path; a second one during its clean-up)
    is one line ``prog: terminated|interrupted`` and exit 143 / 130, not a traceback."""
    with sigterm_raises():
        try:
            return main(argv)
        except KeyboardInterrupt as err:
            how, code = interrupt_exit(err)
            print(f"{prog}: {how}", file=sys.stderr, flush=True)
            return code


def interrupt_exit(err: KeyboardInterrupt) -> tuple[str, int]:
    """``("terminated" | "interrupted", exit status)`` of an interrupt: 143 for :class:`Terminated`, else 130."""
    return ("terminated", 143) if isinstance(err, Terminated) else ("interrupted", EXIT_INTERRUPTED)
