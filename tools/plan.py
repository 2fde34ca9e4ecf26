#!/usr/bin/env python
"""``megaloop plan`` (megaloop/plan/cli.py) runnable from a checkout: ``python tools/plan.py --config L --gpus 64 --search``.

The same entry as the installed command (megaloop/cli.py's ``main``): one line on bad input (exit 2)
and on Ctrl-C (exit 130), the exit status recorded where MEGALOOP_EXIT_STATUS_FILE asks.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megaloop.cli import main as megaloop_main  # noqa: E402
from megaloop.plan.cli import main  # noqa: E402  (the verb's own entry, for importers)

__all__ = ["main"]

if __name__ == "__main__":
    megaloop_main(["plan", *sys.argv[1:]])
