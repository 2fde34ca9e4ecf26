#!/usr/bin/env python
"""Print a training run's totals as JSON and one line: model FLOPs, tokens, depths drawn, final
prior, best/last validation CE (from the cumulative counters in RUN_DIR/metrics.jsonl).

    python tools/run_summary.py runs/S [--json summary.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megaloop.config_utils import ConfigError  # noqa: E402
from megaloop.train.summary import one_line, summarize  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", help="a megaloop run directory (holds metrics.jsonl)")
    p.add_argument("--json", default=None, metavar="OUT", help="also write the summary here")
    args = p.parse_args(argv)
    try:
        s = summarize(args.run_dir)
    except ConfigError as err:
        print(f"run_summary: error: {err}", file=sys.stderr)
        return 2
    text = json.dumps(s, indent=1)
    print(text)
    print(one_line(s))
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
