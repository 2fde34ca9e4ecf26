#!/usr/bin/env python
"""Build the held-out validation set and the frozen LR-screen set from a TxT360 tree.

    python data_prep/build_eval_sets.py --input ROOT --out DIR --tokenizer PATH \
        [--val-seq-len 2048 --val-sequences-per-source 256] \
        [--screen-seq-len 1536 --screen-sequences 304] [--train-manifest TRAIN/manifest.json]

Writes ``DIR/val/`` and ``DIR/screen/`` (MDS + manifest.json with provenance). Both are checked before
anything is written (a screen set that cannot be filled fails before val/ is touched), written into
temporary folders and renamed into place at the end, so sets already in ``DIR`` stay as they were until
the new ones are complete. Sets in ``DIR`` built with other settings (input, tokenizer, seq lengths,
sizes, seed, holdout, compression, --sources) are refused, naming each difference, unless
``--overwrite``; the same command again reuses them (input files changed since: rebuilt). A ``DIR``
holding an MDS dataset (the converter's --out) or inside the input tree is refused.

Provenance: documents are assigned by a salted content hash to the validation band
(``u < val_fraction``), the LR-screen band (``val_fraction <= u < val_fraction +
screen_fraction``) or training; ``txt360_to_mds.py`` drops both bands from the training shards
when run with the same ``--val-fraction/--screen-fraction/--holdout-salt`` (checked against
``--train-manifest`` when given). The validation set is MixVal-style: up to
``--val-sequences-per-source`` packed sequences from each source's distinct held-out documents,
no upsampling. The screen set pools all sources' screen-band documents in seeded-hash order and
packs exactly ``--screen-sequences`` x ``--screen-seq-len`` tokens. ``--max-files-per-source``
limits the scan to each source's first files (sorted) for speed on the full corpus.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from txt360_to_mds import add_holdout_args  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="TxT360 root (holding data/) or its data/ dir")
    p.add_argument("--out", required=True, help="output directory (gets val/ and screen/)")
    p.add_argument("--tokenizer", required=True,
                   help="tokenizer.json / .model / directory, or 'default' (the embedded corpus' BPE)")
    p.add_argument("--val-seq-len", type=int, default=2048)
    p.add_argument("--val-sequences-per-source", type=int, default=256)
    p.add_argument("--screen-seq-len", type=int, default=1536)
    p.add_argument("--screen-sequences", type=int, default=304)
    p.add_argument("--seed", type=int, default=1234, help="seed of the document order")
    p.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), help="scan processes (>= 1)")
    p.add_argument("--sources", help="comma-separated subset of sources")
    p.add_argument("--max-files-per-source", type=int, help="scan only the first N files per source")
    p.add_argument("--train-manifest", help="training manifest.json to check the holdout spec against")
    p.add_argument("--eos-token", help="EOS token string, if the tokenizer does not declare one")
    p.add_argument("--compression", default="zstd", help="shard compression: zstd (default), zstd:1-22, gz, bz2, br, snappy or none")
    p.add_argument("--overwrite", action="store_true",
                   help="replace val/ and screen/ in --out built with other settings (refused otherwise; "
                        "the old sets stay until the new ones are complete)")
    p.add_argument("--no-progress", action="store_true")
    add_holdout_args(p)
    return p.parse_args(argv)


def _remove_created(created: Path, out: Path) -> None:
    """After a failed run: remove ``created``, the folder this run made for ``--out`` (``out`` or a
    folder above it), unless another build holds ``out``'s lock (it then owns what is inside)."""
    import shutil

    from megaloop.data._fsutil import try_lock_fd

    if not created.exists():
        return
    fd = try_lock_fd(out / ".lock") if out.is_dir() else None
    if out.is_dir() and fd is None:
        return  # another build into the same new --out is running
    try:
        shutil.rmtree(created, ignore_errors=True)
    finally:
        if fd is not None:
            os.close(fd)


def main(argv: list[str] | None = None) -> int:
    from megaloop.runtime.stop import run_interruptible

    # SIGTERM (slurm, timeout) takes the interrupt path, as Ctrl-C does (it killed the build without a word)
    return run_interruptible(_build, argv, "build_eval_sets")


def _build(argv: list[str] | None) -> int:
    args = parse_args(argv)
    from megaloop.data.errors import DataError
    from megaloop.data.eval_sets import EvalSetsConfig, build_eval_sets
    from megaloop.data.txt360 import HoldoutSpec

    from megaloop.data._fsutil import first_missing

    created = first_missing(Path(os.path.abspath(args.out)))  # removed again if this run fails
    ok = False
    try:
        tokenizer = args.tokenizer
        if tokenizer == "default":
            from megaloop.data.default_tokenizer import ensure_default_tokenizer

            tokenizer = str(ensure_default_tokenizer())
        res = build_eval_sets(EvalSetsConfig(
            input=Path(args.input), out=Path(args.out), tokenizer=tokenizer,
            holdout=HoldoutSpec(args.val_fraction, args.screen_fraction, args.holdout_salt),
            val_seq_len=args.val_seq_len, val_sequences_per_source=args.val_sequences_per_source,
            screen_seq_len=args.screen_seq_len, screen_sequences=args.screen_sequences,
            seed=args.seed, workers=args.workers, overwrite=args.overwrite,
            sources=args.sources.split(",") if args.sources else None,
            max_files_per_source=args.max_files_per_source, eos_token=args.eos_token,
            compression=None if args.compression == "none" else args.compression,
            train_manifest=Path(args.train_manifest) if args.train_manifest else None,
            progress=not args.no_progress, command=shlex.join([sys.executable, *sys.argv])))
        ok = True
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:
        from megaloop.runtime.stop import interrupt_exit

        how, code = interrupt_exit(err)
        print(f"{how}: nothing half-written is published; rerun the same command", file=sys.stderr)
        return code
    except Exception as err:  # a full disk: one line (it was a traceback), else the traceback
        from megaloop.runtime.files import report_storage_full

        return report_storage_full(err)
    finally:
        if not ok and created is not None:
            _remove_created(created, Path(os.path.abspath(args.out)))
    print(json.dumps({name: {"num_sequences": m["num_sequences"], "seq_len": m["seq_len"],
                             "total_tokens": m["total_tokens"], "path": str(Path(args.out) / name)}
                      for name, m in res.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
