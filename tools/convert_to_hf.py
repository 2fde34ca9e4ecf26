#!/usr/bin/env python
"""``megaloop convert`` (megaloop/hf/convert_cli.py) runnable from a checkout: ``python tools/convert_to_hf.py --checkpoint RUN --out HF``.

The same entry as the installed command (megaloop/cli.py's ``main``): one line on bad input (exit 2)
and on Ctrl-C (exit 130), the exit status recorded where MEGALOOP_EXIT_STATUS_FILE asks.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megaloop.cli import main as megaloop_main  # noqa: E402
from megaloop.hf.convert_cli import main  # noqa: E402  (the verb's own entry, for importers)

__all__ = ["main"]

if __name__ == "__main__":
    megaloop_main(["convert", *sys.argv[1:]])
