"""The one base class of errors caused by what the user gave us (a config field, a file, a rank).

Every command's ``main`` catches :class:`UserError` once and prints one line naming the field,
file or rank at fault, then exits with status 2 (:func:`report`). Subclasses keep their own
names for callers that want to tell them apart (``ConfigError``, ``DataError``,
``CheckpointError``, ``ConversionError``, ...), but none is translated into another.
"""

from __future__ import annotations

import os
import sys

from megaloop.runtime.exits import EXIT_USAGE


class UserError(Exception):
    """Bad input; the message names the field / file / rank at fault (``"model.num_heads: ..."``)."""


def report(err: BaseException, prog: str = "megaloop") -> int:
    """Print ``err`` as one line on stderr (with the distributed rank when there is one; the
    lines of a multi-line message joined by ``"; "``) and return the usage exit status."""
    rank = os.environ.get("RANK")
    text = "; ".join(line.strip() for line in str(err).splitlines() if line.strip())
    print(f"{prog}: error{f' (rank {rank})' if rank else ''}: {text}", file=sys.stderr)
    return EXIT_USAGE
