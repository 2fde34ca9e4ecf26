#!/usr/bin/env python
"""``megaloop convert`` as a script, same arguments (:mod:`megaloop.hf.convert_cli`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megaloop.hf.convert_cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
