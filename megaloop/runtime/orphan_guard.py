"""``python -m megaloop.runtime.orphan_guard PID -- CMD ...``: run ``CMD`` (exec, same pid) so that it
gets SIGTERM when process ``PID``, the sweep launcher that started it, dies, however it dies.

A sweep's local runs start in sessions of their own (a terminal's Ctrl-C reaches only the launcher,
which then asks them to checkpoint), so a ``kill -9`` of the launcher's process group left them
training on as orphans nobody waits for. Linux's ``PR_SET_PDEATHSIG`` survives the ``exec``; the
trainer takes the SIGTERM as "checkpoint, then stop" (exit 75) and a rerun of the sweep resumes it.
Elsewhere the command runs unguarded.
"""

from __future__ import annotations

import os
import signal
import sys


def _set_pdeathsig(sig: int) -> bool:
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(1, int(sig), 0, 0, 0) == 0  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return False


def stop_with_launcher() -> None:
    """Under torchrun (``TORCHELASTIC_RUN_ID`` set), ask for SIGTERM when the launcher (this process's
    parent, torchrun's agent) dies. torchrun starts each rank in a session of its own, so a ``kill -9`` of
    the command's process group killed torchrun alone, and the ranks trained on as orphans (``rl``,
    ``distill-prefill`` and ``train``: their metrics and checkpoints kept growing, and a ``--resume``
    started meanwhile ran beside them on the same folder). The SIGTERM is the usual "checkpoint, then
    stop" (exit 75). torchrun starts its ranks from its main thread, whose end is the process's."""
    if not os.environ.get("TORCHELASTIC_RUN_ID"):
        return
    # a parent pid of 1 is not taken for "torchrun is gone": torchrun may be a container's first process
    parent = os.getppid()
    if _set_pdeathsig(signal.SIGTERM) and os.getppid() != parent:  # it died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--" or not argv[0].isdigit():
        print("usage: python -m megaloop.runtime.orphan_guard PARENT_PID -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    parent, cmd = int(argv[0]), argv[2:]
    _set_pdeathsig(signal.SIGTERM)
    if os.getppid() != parent:  # the launcher died before the request took effect
        return 128 + signal.SIGTERM
    os.execvp(cmd[0], cmd)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
