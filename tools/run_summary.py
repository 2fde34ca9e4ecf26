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
from megaloop.inference.generate_cli import check_out_file  # noqa: E402
from megaloop.runtime.files import atomic_write_text, json_safe  # noqa: E402
from megaloop.train.summary import is_run_file, one_line, summarize  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("run_dir", help="a megaloop run directory (holds metrics.jsonl), or its metrics.jsonl")
    p.add_argument("--json", default=None, metavar="OUT", help="also write the summary here")
    args = p.parse_args(argv)
    try:
        _check_out(args.json, Path(args.run_dir))
        s = summarize(args.run_dir)
        text = json.dumps(json_safe(s), indent=1, allow_nan=False)  # NaN / inf as null: JSON has neither
        print(text)
        print(one_line(s))
        if args.json:
            try:
                _write(Path(args.json), text + "\n")
            except OSError as err:
                raise ConfigError(f"--json {args.json}: cannot be written ({err.strerror or err})") from None
    except ConfigError as err:
        print(f"run_summary: error: {err}", file=sys.stderr)
        return 2
    return 0


def _stream(path: Path) -> bool:
    """An existing file that is not a regular file: a terminal, a pipe (``/dev/stdout``, ``>(jq .)``)."""
    return path.exists() and not path.is_file() and not path.is_dir()


def _write(path: Path, text: str) -> None:
    """Into a stream as it is; else whole or not at all (through a link to its target, which it keeps)."""
    if _stream(path):
        with open(path, "w") as f:
            f.write(text)
        return
    target = path.resolve() if path.is_symlink() else path
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(target, text)


def _check_out(out: str | None, run_dir: Path) -> None:
    """``--json`` must be writable (:func:`megaloop.inference.generate_cli.check_out_file`) and must not
    be one of the run's own files (its metrics log, config, data record, tokenizer, checkpoints)."""
    if not out or _stream(Path(out)):
        return
    check_out_file(out, "--json")
    if is_run_file(out, run_dir):
        raise ConfigError(f"--json {out}: is one of the run's own files; write the summary elsewhere "
                          f"(e.g. {run_dir / 'summary.json'})")


if __name__ == "__main__":
    sys.exit(main())
