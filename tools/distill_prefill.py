#!/usr/bin/env python
"""Distilled prefill (SPEC §10): train a student that predicts the teacher's depth-R endpoint from
the prelude output. Megaloop checkpoint or HF folder in, student folder out. See ``--help`` and
:mod:`megaloop.distill.cli`.

    python tools/distill_prefill.py --teacher hf/S --out students/S --depth 5 --steps 2000
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
warnings.filterwarnings("ignore")

from megaloop.distill.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
