#!/usr/bin/env python
"""GRPO with endpoint reuse (SPEC §9) on a verifiable task; megaloop checkpoint or HF folder in,
HF folder out. See ``python tools/rl_train.py --help`` and :mod:`megaloop.rl.cli`.

    python tools/rl_train.py --model RUN/checkpoints --out hf/rl --task arithmetic --arm reuse \\
        --recurrences 5 --neumann-b 5 --steps 50
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
warnings.filterwarnings("ignore")

from megaloop.rl.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
