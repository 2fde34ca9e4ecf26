"""``megaloop eval synth``: the k × R answer table of the synthetic programs (and a PNG).

Hooked into ``megaloop eval`` by :func:`add_synth_parser` (``megaloop/eval/cli.py``)::

    megaloop eval synth --checkpoint RUN [--problems heldout.jsonl] [--depths 1,2,4,5,8,16]
        [--cache terminal|per_visit|none] [--scoring decode|parallel] [--limit N] [--plot synth.png]

Each depth R is both the prefill and the decode budget (``--prefill-depth`` pins the prefill
instead); ``--depth``/``--decode-depth`` do not apply (the sweep is ``--depths``). Also runnable
as ``python -m megaloop.eval.synth_cli --checkpoint RUN ...``.
"""

from __future__ import annotations

import argparse
import sys

from megaloop.config_utils import ConfigError
from megaloop.inference.generate_cli import (add_engine_options, add_memory_option, build_engine, check_engine_args,
                                             check_outputs_not_inputs, check_plot_path, write_json)


def add_synth_parser(sub) -> None:
    """Add ``synth`` to the ``megaloop eval`` sub-parsers ``sub``."""
    p = sub.add_parser("synth", help="synthetic programs: answer accuracy / CE per chain length k and depth R "
                                     "(table + PNG)")
    add_engine_options(p, cache_choices=("terminal", "per_visit", "none"))
    p.add_argument("--problems", default=None,
                   help="held-out JSONL (make_synth.py's ROOT/heldout.jsonl; default: the shipped "
                        "megaloop/eval/tasks/megaloop_synth.jsonl)")
    p.add_argument("--depths", default="1,2,4,5,8,16", help="comma-separated depths R")
    p.add_argument("--ks", default=None, help="chain lengths to score, e.g. 1-4 or 1,3,5 (default: all)")
    p.add_argument("--limit", type=int, default=None, help="problems per k (default: all)")
    p.add_argument("--scoring", choices=("decode", "parallel"), default=None,
                   help="decode (default: answer token by token through the cache) or parallel "
                        "(the default with --cache none)")
    p.add_argument("--batch-size", type=int, default=64, help="problems scored together")
    p.add_argument("--plot", default=None, help="PNG path (default: next to --json, else synth_table.png)")
    add_memory_option(p)
    p.set_defaults(fn=cmd_synth)


def _parse_ks(text: str | None) -> list[int] | None:
    if not text:
        return None
    out: set[int] = set()
    for part in filter(None, (s.strip() for s in text.split(","))):
        lo, _, hi = part.partition("-")
        try:
            out.update(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            raise ConfigError(f"--ks: {part!r} is not k or k1-k2") from None
    return sorted(out)


def cmd_synth(args: argparse.Namespace) -> int:
    """Print the k × R table, write the PNG (and ``--json``)."""
    from megaloop.eval.decode_score import check_scoring
    from megaloop.eval.depth_sweep import parse_depths
    from megaloop.eval.synth import SHIPPED, load_problems, plot_synth, synth_table

    for flag in ("depth", "decode_depth"):
        if getattr(args, flag, None) is not None:
            raise ConfigError(f"--{flag.replace('_', '-')}: not used by eval synth (every depth of --depths is "
                              "both the prefill and the decode budget; --prefill-depth pins the prefill)")
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size: must be >= 1, got {args.batch_size}")
    check_engine_args(args)
    check_scoring(args.scoring or ("parallel" if args.cache == "none" else "decode"), args.cache)
    depths = parse_depths(args.depths)
    plot = check_plot_path(args.plot, args.json, "synth_table.png")
    check_outputs_not_inputs(args, {"--json": args.json, "--plot": str(plot)})
    problems = load_problems(args.problems or SHIPPED, _parse_ks(args.ks), args.limit)
    engine = build_engine(args, cache_mode="per_visit" if args.cache == "per_visit" else "terminal")
    table = synth_table(engine, problems, depths, cache_mode=args.cache, scoring=args.scoring,
                        prefill_depth=args.prefill_depth, batch_size=args.batch_size,
                        memory_check=not args.no_memory_check,
                        log=lambda r, s: print(f"R={r}: {len(problems)} problems in {s:.1f} s", flush=True))
    print(table.format())
    write_json(args.json, {"command": "eval synth", "engine": engine.describe(),
                           "problems": str(args.problems or SHIPPED), **table.to_dict(), "plot": str(plot)})
    print(f"wrote {plot_synth(table, plot)}")  # after the JSON: a failing plot loses no result
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m megaloop.eval.synth_cli --checkpoint RUN ...`` (the same as ``megaloop eval synth``)."""
    from megaloop.errors import UserError, report

    parser = argparse.ArgumentParser(prog="megaloop eval")
    add_synth_parser(parser.add_subparsers(dest="eval_cmd", required=True))
    args = parser.parse_args(["synth", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.fn(args)
    except UserError as err:
        return report(err)


__all__ = ["add_synth_parser", "cmd_synth", "main"]

if __name__ == "__main__":
    sys.exit(main())
