"""The one base class of errors caused by what the user gave us (a config field, a file, a rank).

Every command's ``main`` catches :class:`UserError` once and prints one line naming the field,
file or rank at fault, then exits with status 2 (:func:`report`). Subclasses keep their own
names for callers that want to tell them apart (``ConfigError``, ``DataError``,
``CheckpointError``, ...), but none is translated into another.
"""

from __future__ import annotations

import os
import sys

EXIT_USAGE = 2  # bad input: config field, file, checkpoint, data


class UserError(Exception):
    """Bad input; the message names the field / file / rank at fault (``"model.num_heads: ..."``)."""


def report(err: BaseException, prog: str = "megaloop") -> int:
    """Print ``err`` as one line on stderr (with the distributed rank when there is one) and
    return the usage exit status."""
    rank = os.environ.get("RANK")
    print(f"{prog}: error{f' (rank {rank})' if rank else ''}: {err}", file=sys.stderr)
    return EXIT_USAGE
