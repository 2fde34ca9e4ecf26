"""Reading a checkpoint of a run that may still be training in its folder.

A run prunes its older checkpoints as it saves (``train.keep_checkpoints``): a reader that picked
the newest one (``--checkpoint RUN`` or ``RUN/checkpoints``) can see it renamed away part-way
through the read. :func:`load_newest` reads again at the run's now-newest checkpoint (with a note)
instead of calling the vanished folder "damaged or truncated", names a step folder given by path
that was pruned (one line, pointing at its ``checkpoints`` folder), and drops torch's fallback
warnings, which print a traceback when ``.metadata`` vanishes under the read.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Callable, TypeVar, Union

T = TypeVar("T")

# torch.distributed.checkpoint's loader logs these on the root logger, with exc_info
_DCP_FALLBACK = ("Global metadata is not found", "Rank local metadata is not found")


class _DropDcpFallback(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_DCP_FALLBACK)


def pruned_hint(path: Path) -> str:
    """`` (…)`` for a ``step_*`` folder that is gone while its ``checkpoints`` folder holds a newer one
    (a run training there pruned it), else ``""`` (a typo, or a step not written yet)."""
    from megaloop.train.checkpoint import step_of

    if path.exists() or not path.parent.is_dir() or path.name != f"step_{step_of(path):08d}":
        return ""
    newer = [p for p in path.parent.glob("step_*") if step_of(p) > step_of(path)]
    if not newer:
        return ""
    newest = max(newer, key=step_of)
    return (f" (removed: {path.parent} now holds {newest.name}; a run training there prunes its older checkpoints, "
            f"train.keep_checkpoints; pass {path.parent} for its newest)")


def load_newest(checkpoint: Union[str, Path], load: Callable[[Path], T], tries: int = 3) -> T:
    """``load(step folder)`` (:func:`megaloop.hf.convert.load_native`) of ``checkpoint`` (a step folder,
    ``RUN/checkpoints`` or ``RUN``) resolved once to one step folder; when that folder is removed during
    the read (pruned by a training run) and ``checkpoint`` named a folder of checkpoints, the newest
    one is read instead (up to ``tries`` times, a note on stderr each time; one process only: the
    ranks of a launch, which read together, would not retry together). CheckpointError naming the
    step otherwise (a real defect of a folder still there keeps the load's own message)."""
    from megaloop.train.checkpoint import CheckpointError, find_checkpoint

    given = Path(checkpoint)
    drop, root = _DropDcpFallback(), logging.getLogger()
    for attempt in range(1, tries + 1):
        try:
            chosen = find_checkpoint(given)
        except CheckpointError as err:
            raise CheckpointError(f"{err}{pruned_hint(given)}") from None
        root.addFilter(drop)
        try:
            return load(chosen)
        except (CheckpointError, OSError):
            if chosen.is_dir():  # still there: the checkpoint itself is at fault
                raise
            if chosen.resolve() == given.resolve() or _several_ranks():  # ranks would not retry together
                raise CheckpointError(f"checkpoint {chosen} was removed while it was read{pruned_hint(chosen)}") \
                    from None
            if attempt == tries:
                raise CheckpointError(f"{given}: its newest checkpoint was removed while it was read, {tries} times "
                                      "in a row (a run training there prunes them: train.keep_checkpoints); run "
                                      "the command again") from None
            print(f"note: {chosen} was removed while it was read (a run training in {given} prunes its older "
                  "checkpoints); reading its newest again", file=sys.stderr, flush=True)
        finally:
            root.removeFilter(drop)
    raise AssertionError("unreachable")


def _several_ranks() -> bool:
    import torch

    return torch.distributed.is_available() and torch.distributed.is_initialized() \
        and torch.distributed.get_world_size() > 1


__all__ = ["load_newest", "pruned_hint"]
