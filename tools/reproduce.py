#!/usr/bin/env python
"""``megaloop reproduce`` (megaloop/repro/cli.py), runnable from a checkout."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megaloop.repro.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
