"""``megaloop eval synth``: the k × R answer table of the synthetic programs (and a PNG).

Hooked into ``megaloop eval`` by :func:`add_synth_parser` (``megaloop/eval/cli.py``)::

    megaloop eval synth --checkpoint RUN [--problems heldout.jsonl] [--depths 1,2,4,5,8,16]
        [--cache terminal|per_visit|none] [--scoring decode|parallel] [--limit N] [--plot synth.png]

Each depth R is both the prefill and the decode budget (``--prefill-depth`` pins the prefill
instead); ``--depth``/``--decode-depth`` do not apply (the sweep is ``--depths``). With ``--exit``
the answer tokens of column R decode at adaptive depth capped at R (``--max-depth`` is refused, as
in ``eval sweep --sharing``). Parallel scoring (``--scoring parallel``, ``--cache none``) decodes
nothing, so it refuses the adaptive-depth options, and ``--cache none`` (no prefill) refuses
``--prefill-depth``. An untied (non-looped) checkpoint has no depth: ``--depths`` is refused and
the table has one column, labelled with the run's eval depth (as ``eval ppl`` reports it). Also
runnable as ``python -m megaloop.eval.synth_cli --checkpoint RUN ...``.
"""

from __future__ import annotations

import argparse
import sys

from megaloop.config_utils import ConfigError
from megaloop.inference.generate_cli import (add_engine_options, add_memory_option, build_engine, check_engine_args,
                                             check_outputs_not_inputs, check_plot_path, hide_options, write_json)


def add_synth_parser(sub) -> None:
    """Add ``synth`` to the ``megaloop eval`` sub-parsers ``sub``."""
    p = sub.add_parser("synth", help="synthetic programs: answer accuracy / CE per chain length k and depth R "
                                     "(table + PNG)")
    add_engine_options(p, cache_choices=("terminal", "per_visit", "none"))
    p.add_argument("--problems", default=None,
                   help="held-out JSONL (make_synth.py's ROOT/heldout.jsonl; default: the shipped "
                        "megaloop/eval/tasks/megaloop_synth.jsonl)")
    p.add_argument("--depths", default=None,
                   help="comma-separated depths R (default 1,2,4,5,8,16; refused for an untied model)")
    p.add_argument("--ks", default=None, help="chain lengths to score, e.g. 1-4 or 1,3,5 (default: all)")
    p.add_argument("--limit", type=int, default=None, help="problems per k (default: all)")
    p.add_argument("--scoring", choices=("decode", "parallel"), default=None,
                   help="decode (default: answer token by token through the cache) or parallel "
                        "(the default with --cache none)")
    p.add_argument("--batch-size", type=int, default=64, help="problems scored together")
    p.add_argument("--plot", default=None, help="PNG path (default: next to --json, else synth_table.png)")
    hide_options(p, "depth", "decode_depth", "max_depth")  # refused (cmd_synth): --depths set them
    add_memory_option(p)
    p.set_defaults(fn=cmd_synth)


def _parse_ks(text: str | None) -> list[int] | None:
    if not text:
        return None
    out: set[int] = set()
    for part in (s.strip() for s in text.split(",")):
        lo, _, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise ConfigError(f"--ks: {part!r} is not k or k1-k2 (in {text!r})") from None
        if last < first:  # it selected nothing and the shipped file was blamed for holding no problem
            raise ConfigError(f"--ks: the range {part!r} runs backwards")
        out.update(range(first, last + 1))
    return sorted(out)


def cmd_synth(args: argparse.Namespace) -> int:
    """Print the k × R table, write the PNG (and ``--json``)."""
    from megaloop.eval.decode_score import check_scoring
    from megaloop.eval.depth_sweep import parse_depths
    from megaloop.eval.synth import (DEFAULT_DEPTHS, SHIPPED, load_problems, old_generator_note, plot_synth,
                                      run_heldout, synth_table)
    from megaloop.inference.generate_cli import is_untied

    for flag in ("depth", "decode_depth"):
        if getattr(args, flag, None) is not None:
            raise ConfigError(f"--{flag.replace('_', '-')}: not used by eval synth (every depth of --depths is "
                              "both the prefill and the decode budget; --prefill-depth pins the prefill)")
    if args.max_depth is not None:
        raise ConfigError("--max-depth: eval synth caps the adaptive depth of each column at its own depth "
                          "(--depths); drop it")
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size: must be >= 1, got {args.batch_size}")
    scoring = check_scoring(args.scoring or ("parallel" if args.cache == "none" else "decode"), args.cache)
    check_parallel_options(args, scoring)
    depths = parse_depths(args.depths if args.depths is not None else DEFAULT_DEPTHS)
    if args.exit:  # every column's cap is its own R (row_policy); the engine's policy must admit the deepest
        if args.min_depth is not None and args.min_depth > max(depths):
            raise ConfigError(f"--min-depth {args.min_depth}: above every depth of --depths (the deepest is "
                              f"{max(depths)}), so no column could exit early; lower it or add a deeper R")
        args.max_depth = max(max(depths), args.min_depth if args.min_depth is not None else 2)
    check_engine_args(args)
    untied = is_untied(args)
    if untied and args.depths is not None:
        raise ConfigError(f"--depths: {args.checkpoint} is an untied (non-looped) model, it has no depth to vary")
    plot = check_plot_path(args.plot, args.json, "synth_table.png")
    check_outputs_not_inputs(args, {"--json": args.json, "--plot": str(plot)})
    source = args.problems or run_heldout(args.checkpoint)  # the run's own tree's set: the shipped one
    if source is not None and not args.problems:  # is that of the default settings alone
        print(f"problems: {source} (the held-out set of the synthetic tree the run trained on; --problems "
              "chooses another)", flush=True)
    source = source or SHIPPED
    if (note := old_generator_note(args.checkpoint)) is not None:
        print(note, file=sys.stderr, flush=True)
    problems = load_problems(source, _parse_ks(args.ks), args.limit)
    engine = build_engine(args, cache_mode="per_visit" if args.cache == "per_visit" else "terminal")
    if not engine.config.looped:  # one pass: every depth would give the same column; one, at the run's eval depth
        if args.depths is not None:
            raise ConfigError(f"--depths: {args.checkpoint} is an untied (non-looped) model, it has no depth to vary")
        depths = [engine.depth]
    table = synth_table(engine, problems, depths, cache_mode=args.cache, scoring=args.scoring,
                        prefill_depth=args.prefill_depth, batch_size=args.batch_size,
                        memory_check=not args.no_memory_check,
                        log=lambda r, s: print(f"R={r}: {len(problems)} problems in {s:.1f} s", flush=True))
    if not engine.config.looped:
        table.protocol["arch"] = "untied (one pass, no recurrence depth)"
    print(table.format())
    for r, stats in zip(table.depths, table.adaptive_depths or []):
        if stats is not None:
            print(f"R={r} adaptive decode ({stats['criterion']}, max depth {stats['max_depth']}): "
                  f"{_depth_summary(stats)}")
    write_json(args.json, {"command": "eval synth", "engine": engine.describe(),
                           "problems": str(source), **table.to_dict(), "plot": str(plot)})
    print(f"wrote {plot_synth(table, plot)}")  # after the JSON: a failing plot loses no result
    return 0


def check_parallel_options(args: argparse.Namespace, scoring: str) -> None:
    """Refuse the options parallel scoring would ignore (one line, before anything loads): the
    adaptive-depth options (nothing is decoded token by token) and, with ``--cache none`` (one
    plain parallel forward over prompt and answer, no prefill), ``--prefill-depth``."""
    if scoring != "parallel":
        return
    how = "--cache none" if args.cache == "none" else "--scoring parallel"
    for flag, given in (("--exit", args.exit is not None), ("--min-depth", args.min_depth is not None),
                        ("--max-depth", args.max_depth is not None),
                        ("--finished-rows", args.finished_rows != "mask")):
        if given:
            raise ConfigError(f"{flag}: adaptive depth applies to token-by-token decode scoring; with {how} each "
                              "answer is scored in one parallel pass at R (use --scoring decode with --cache "
                              "terminal|per_visit, or drop it)")
    if args.cache == "none" and args.prefill_depth is not None:
        raise ConfigError("--prefill-depth: with --cache none prompt and answer are scored in one plain parallel "
                          "forward at each R, with no prefill (use --cache terminal|per_visit, or drop it)")


def _depth_summary(stats: dict) -> str:
    """One line of a column's adaptive depths (``SynthTable.adaptive_depths[j]``)."""
    if not stats.get("tokens"):
        return "no decode steps (one-token answers are scored from the prefill)"
    hist = " ".join(f"{d}:{c}" for d, c in stats["histogram"].items())
    return f"mean depth {stats['mean_depth']:.2f} over {stats['tokens']} answer-token decode steps; depth:tokens {hist}"


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


__all__ = ["add_synth_parser", "check_parallel_options", "cmd_synth", "main"]

if __name__ == "__main__":
    sys.exit(main())
