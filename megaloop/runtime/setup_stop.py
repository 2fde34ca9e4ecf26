"""SIGTERM / SIGUSR1 before a training loop's own handler is in place (``megaloop`` set-up).

:func:`megaloop.cli.main` installs :func:`install`'s handler for the verbs with a training loop
(``train``, ``rl``, ``distill-prefill``: SIGTERM and SIGUSR1) and for ``convert`` (SIGTERM), so a
stop while torch loads, the model is built or the data is checked raises :class:`StopDuringSetup`
(the command prints one line, :func:`stopped_line`, and exits 75 for a training verb, nothing being
checkpointed; 143 for convert, whose ``finally`` removes its staging folder; 130 for ``lr-screen`` /
``reproduce`` outside their pool's runs, as their Ctrl-C) instead of a silent 143. :class:`megaloop.runtime.stop.SignalStop` replaces the handler for the loop's steps and puts
it back after them; from then on (:func:`loop_entered`) the handler gives the signal its default
action, as before the loop existed (a finished run is not reported as stopped in set-up).

A signal that arrives while the process waits in a C call (a rendezvous, a barrier) is acted on
when the call returns. Outside the main thread nothing is installed (Python allows handlers only
there); :func:`restore` puts back what was there before."""

from __future__ import annotations

import os
import signal
import sys
import threading

from megaloop.runtime.exits import EXIT_REQUEUE

LOOPS = ("train", "rl", "distill-prefill")
SWEEPS = ("lr-screen", "reproduce")  # their pool takes SIGTERM over while runs train (megaloop.sweep)
SIGNALS = {**{v: ("SIGTERM", "SIGUSR1") for v in LOOPS}, "convert": ("SIGTERM",), **{v: ("SIGTERM",) for v in SWEEPS}}
_state = {"loop": False}


class StopDuringSetup(BaseException):
    """A stop signal before the loop's handler took over (a BaseException, as KeyboardInterrupt)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _handler(signum: int, _frame) -> None:
    if _state["loop"]:  # the loop ran and put this back: the default action, as before it existed
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    raise StopDuringSetup(signum)


def loop_entered() -> None:
    """Called by :class:`~megaloop.runtime.stop.SignalStop` when a loop takes the signals over."""
    _state["loop"] = True


def install(verb: str | None) -> dict[int, object]:
    """Install the handler for ``verb``'s signals; the previous handlers ({} when none installed)."""
    _state["loop"] = False
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {}
    for name in SIGNALS.get(verb or "", ()):
        if hasattr(signal, name):
            sig = int(getattr(signal, name))
            previous[sig] = signal.signal(sig, _handler)
    return previous


def restore(previous: dict[int, object]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def stopped_line(verb: str, signum: int, argv: list[str] = ()) -> int:
    """Print the one line of a stop in set-up (``argv``: the command's arguments); the exit status."""
    name = signal.Signals(signum).name
    if verb == "reproduce" and "--evaluate-arm" in argv:  # the child a sweep starts after an arm's training
        print(f"megaloop reproduce --evaluate-arm: stopped by {name} (the arm is evaluated again on the next "
              "run of the experiment)", file=sys.stderr)
        return 130
    if verb in SWEEPS:  # as their Ctrl-C: 130 (README); their runs checkpoint in the pool's own handler
        print(f"megaloop {verb}: stopped by {name} outside its local runs (finished runs and results are kept, "
              "submitted slurm jobs keep running; rerun the same command to continue)", file=sys.stderr)
        return 130
    if verb not in LOOPS:
        print(f"megaloop {verb}: stopped by {name} (its temporary files removed; --out is never left "
              "half-written)", file=sys.stderr)
        return 128 + signum
    resume = "--resume auto" if verb == "train" else "--resume"
    print(f"megaloop {verb}: stopped by {name} during set-up, before the first step (no checkpoint written "
          f"by this stop; {resume} continues from the last one, if there is one)", file=sys.stderr)
    return EXIT_REQUEUE
