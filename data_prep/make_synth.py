#!/usr/bin/env python
"""Write the depth-hungry synthetic source (straight-line programs over Z_m) as a TxT360 tree.

    python data_prep/make_synth.py --out ROOT [--num-docs 200000] [--modulus 5] [--ops +*] [--k-min 1 --k-max 6]
        [--n-vars 1] [--scratch 1.0] [--scratch-lines 0.5] [--no-mark-hidden] [--eval-ks 1-8] [--eval-per-k 50]
        [--with-default-corpus]

Writes (``megaloop.data.synth``): ``ROOT/data/synth-programs/1-1/<i>_<n>.jsonl`` (records
``{"text", "meta": {"k", "answer", "scratch", ...}}``), ``ROOT/heldout.jsonl`` (held-out problems:
``id, k, prompt, target, answer``; never in the training files), ``ROOT/tokenizer/`` (a character
level tokenizer: byte-level BPE with no merges, 259 ids) and ``ROOT/synth.json`` (settings, last).
Deterministic per ``--seed`` / ``--eval-seed``; the defaults reproduce the held-out set shipped as
the lm-eval task ``megaloop_synth`` (``megaloop/eval/tasks/megaloop_synth.jsonl``).

Then make MDS shards with the same converter as TxT360, keeping each program in one row:

    python data_prep/txt360_to_mds.py --input ROOT --out MDS --tokenizer ROOT/tokenizer \\
        --seq-len 128 --packing whole --val-fraction 0 --screen-fraction 0

Mixing: ``--with-default-corpus`` also links the embedded corpus' tree (python-code, python-docs,
python-tests) into ``ROOT/data``; weight the sources at conversion, e.g. ``--source-weights
synth-programs=2`` (use ``--tokenizer default`` and the embedded corpus' holdout bands
``--val-fraction 0.1 --screen-fraction 0.1`` so its held-out documents stay out of training). To
mix into a TxT360 run, point ``--out`` at a fresh directory and copy or link
``ROOT/data/synth-programs`` next to the TxT360 sources.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path


def parse_ks(text: str) -> tuple[int, ...]:
    """``"1-8"`` or ``"1,2,4"`` (or a mix) -> sorted unique k values."""
    from megaloop.config_utils import ConfigError

    out: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, _, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi or lo)
        except ValueError:
            raise ConfigError(f"--eval-ks: {part!r} is not k or k1-k2") from None
        if b < a:
            raise ConfigError(f"--eval-ks: range {part!r} runs backwards (write {b}-{a})")
        out.update(range(a, b + 1))
    return tuple(sorted(out))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="root of the TxT360 tree to write (fresh directory)")
    p.add_argument("--num-docs", type=int, default=200_000, help="training programs")
    p.add_argument("--num-files", type=int, default=4, help="JSONL files (one converter partition each)")
    p.add_argument("--seed", type=int, default=1234, help="seed of the training programs")
    p.add_argument("--modulus", type=int, default=5, help="m: values live in Z_m, print(x%%m)")
    p.add_argument("--k-min", type=int, default=1, help="fewest target updates per training program")
    p.add_argument("--k-max", type=int, default=6, help="most target updates per training program")
    p.add_argument("--n-vars", type=int, default=1, help="variables per program (1: one running value)")
    p.add_argument("--ops", default="+*", help="update operators, a subset of +-*")
    p.add_argument("--var-operand", type=float, default=0.3,
                   help="probability that an update reads another variable (n-vars > 1)")
    p.add_argument("--reassign", type=float, default=0.3,
                   help="probability of a distractor reassignment before each update (n-vars > 1)")
    p.add_argument("--scratch", type=float, default=1.0,
                   help="share of training programs showing intermediate values as #comments")
    p.add_argument("--scratch-lines", type=float, default=0.5,
                   help="in those programs, probability that each update shows its value (below 1: "
                        "hidden runs between shown values must be computed internally)")
    p.add_argument("--mark-hidden", action=argparse.BooleanOptionalAction, default=True,
                   help="hidden updates carry a '#?' comment (held-out prompts: on every update)")
    p.add_argument("--eval-ks", default="1-8", help="k values of the held-out problems, e.g. 1-8 or 1,2,4")
    p.add_argument("--eval-per-k", type=int, default=50, help="held-out problems per k")
    p.add_argument("--eval-seed", type=int, default=20, help="seed of the held-out problems")
    p.add_argument("--no-tokenizer", action="store_true", help="do not write ROOT/tokenizer")
    p.add_argument("--with-default-corpus", action="store_true",
                   help="also link the embedded corpus' TxT360 tree into ROOT/data (for mixing)")
    return p.parse_args(argv)


def _check_default_corpus(root: Path) -> None:
    from megaloop.data.default_corpus import ensure_corpus_tree
    from megaloop.errors import UserError

    for src in sorted((ensure_corpus_tree() / "data").iterdir()):
        if (root / "data" / src.name).exists():
            raise UserError(f"--with-default-corpus: {root / 'data' / src.name} already exists; write to a fresh --out")


def _link_default_corpus(root: Path) -> list[str]:
    """Hard-link (copy if refused) the embedded corpus' sources into ``root/data``."""
    from megaloop.data.default_corpus import ensure_corpus_tree
    from megaloop.errors import UserError

    tree = ensure_corpus_tree()
    names = []
    for src in sorted((tree / "data").iterdir()):
        dst = root / "data" / src.name
        if dst.exists():
            raise UserError(f"--with-default-corpus: {dst} already exists; write to a fresh --out")

        def link(a: str, b: str) -> None:
            try:
                os.link(a, b)
            except OSError:
                shutil.copy2(a, b)

        shutil.copytree(src, dst, copy_function=link)
        names.append(src.name)
    return names


def main(argv: list[str] | None = None) -> int:
    from megaloop.runtime.stop import run_interruptible

    # SIGTERM (slurm, timeout) takes the interrupt path, as Ctrl-C does, which removes the partial tree
    return run_interruptible(_make, argv, "make_synth")


def _make(argv: list[str] | None) -> int:
    args = parse_args(argv)
    from megaloop.errors import UserError, report
    from megaloop.data.synth import SynthConfig, TreeSpec, write_synth_tree

    try:
        synth = SynthConfig(modulus=args.modulus, k_min=args.k_min, k_max=args.k_max, n_vars=args.n_vars,
                            ops=args.ops, var_operand=args.var_operand, reassign=args.reassign,
                            scratch=args.scratch, scratch_lines=args.scratch_lines,
                            mark_hidden=args.mark_hidden)
        spec = TreeSpec(num_docs=args.num_docs, num_files=args.num_files, seed=args.seed,
                        eval_ks=parse_ks(args.eval_ks), eval_per_k=args.eval_per_k,
                        eval_seed=args.eval_seed, synth=synth)
        root = Path(args.out)
        if args.with_default_corpus:  # a clash is refused before the tree is written (it was after)
            _check_default_corpus(root)
        info = write_synth_tree(root, spec, tokenizer=not args.no_tokenizer,
                                add_sources=_link_default_corpus if args.with_default_corpus else None)
    except UserError as err:
        return report(err, "make_synth")
    except KeyboardInterrupt as err:  # write_synth_tree removed what it wrote (it was a traceback and half a tree)
        from megaloop.runtime.stop import interrupt_exit

        how, code = interrupt_exit(err)
        print(f"make_synth: {how}: --out {args.out} is as it was", file=sys.stderr)
        return code
    print(json.dumps({"out": str(root), "num_docs": info["num_docs"], "train_chars": info["train_chars"],
                      "heldout": info["heldout"]["num"], **({"linked_sources": info["linked_sources"]}
                                                           if "linked_sources" in info else {})}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
