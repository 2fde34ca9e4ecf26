#!/usr/bin/env python
"""Thin entry for ``megaloop plan`` (megaloop/plan/cli.py): ``python tools/plan.py --config L --gpus 64 --search``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megaloop.plan.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
