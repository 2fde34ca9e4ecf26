#!/usr/bin/env python
"""Convert a local TxT360 tree into packed, tokenised MDS shards for megaloop.

    python data_prep/txt360_to_mds.py --input ROOT --out DIR --tokenizer PATH --seq-len N [--workers K]

Input: ``ROOT/data/<source>/<dup-bucket>/<i>_<n>.jsonl[.gz]`` (records with ``text`` and ``meta``).
Output: ``DIR/index.json`` + ``DIR/parts/*/shard.*.mds.zstd`` (samples: ``tokens`` = N token ids,
``source``) and ``DIR/manifest.json`` (written last; sources, per-source token counts, tokenizer
hash, seq_len, vocab_size, eos_id, total_tokens, num_sequences, mixture, holdout spec).

Mixing (defaults): source weight 1 for every source; bucket upsampling 1-1:1, 2-5:2, 6-10:3,
11-100:4, 101-1000:5, 1001-inf:5, 1001-30000000:5 (Common Crawl's name for its top bucket) (copies per document; fractional parts choose documents by
seeded hash). Override with ``--weights FILE`` (YAML/JSON with ``source_weights`` and/or
``bucket_upsample``) and/or ``--source-weights cc=1,wiki=2 --bucket-upsample 2-5=1.5``.

Packing: ``--packing concat`` (default) concatenates documents and cuts rows every N tokens (rows
cross document boundaries; the tail is dropped). ``--packing whole`` keeps every document inside
one row (next-fit in the shuffled order, the rest of a row padded; an extra ``num_tokens`` column
tells the loader to mask the padding from the loss); a document longer than N tokens is an error
naming ``file:line``. Use it for short documents such as ``make_synth.py``'s programs.

Held-out documents (``--val-fraction`` 0.002, ``--screen-fraction`` 0.001 of documents by salted
content hash) are excluded here and collected by ``build_eval_sets.py`` with the same flags.

Deterministic for a given ``--seed``; resumable (finished input files are skipped on rerun; changed
or added input files are converted and parts of removed ones dropped; the earlier dataset stays
published until the update is complete); crash-safe (files are published by rename, the manifest
last). An ``--out`` holding a dataset from another input or with other settings is refused unless
``--overwrite``; a non-empty ``--out`` that holds no dataset is refused, and so are an ``--out`` that
cannot be created or written and one inside the input tree's ``data/`` folder. One conversion per
``--out`` at a time: a second one names the holder of ``OUT/.lock`` (pid, host) and waits. SIGTERM
(exit 143) or Ctrl-C (130) stops the workers and keeps finished parts; the workers also end if the
main process is killed outright.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path


def add_holdout_args(p: argparse.ArgumentParser) -> None:
    """Flags shared with build_eval_sets.py (must match between the two)."""
    p.add_argument("--val-fraction", type=float, default=0.002,
                   help="fraction of documents (by content hash) held out for validation")
    p.add_argument("--screen-fraction", type=float, default=0.001,
                   help="fraction of documents (by content hash) held out for the LR-screen set")
    p.add_argument("--holdout-salt", default="megaloop-holdout-v1",
                   help="salt of the holdout hash (change it to draw different held-out sets; its first 64 "
                        "UTF-8 bytes are the hash key, so salts that differ only after them draw the same sets)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="TxT360 root (holding data/) or its data/ dir")
    p.add_argument("--out", required=True, help="output directory of the MDS dataset")
    p.add_argument("--tokenizer", required=True,
                   help="tokenizer.json, SentencePiece .model, a directory holding one, or 'default' "
                        "(the embedded corpus' 4,096-token BPE)")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per packed sequence")
    p.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1),
                   help="parallel worker processes (one input file at a time each; >= 1)")
    p.add_argument("--seed", type=int, default=1234, help="seed of upsampling and doc order")
    p.add_argument("--packing", choices=("concat", "whole"), default="concat",
                   help="concat: rows cut across documents (default); whole: no document crosses a row, "
                        "padding masked from the loss")
    p.add_argument("--weights", help="YAML/JSON file with source_weights / bucket_upsample")
    p.add_argument("--source-weights", help="per-source weights, e.g. cc=1,arxiv=2")
    p.add_argument("--bucket-upsample", help="per-bucket factors, e.g. 1-1=1,2-5=2,6-10=3")
    p.add_argument("--sources", help="comma-separated subset of sources to convert")
    p.add_argument("--eos-token", help="EOS token string, if the tokenizer does not declare one")
    p.add_argument("--compression", default="zstd", help="shard compression: zstd (default), zstd:1-22, gz, bz2, br, snappy or none")
    p.add_argument("--shard-size", type=int, default=1 << 26, help="max shard bytes (default 64 MiB)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a dataset in --out that was converted from another input or with other "
                        "settings (refused otherwise; changed input files alone update it in place)")
    p.add_argument("--no-progress", action="store_true", help="disable the progress bar")
    add_holdout_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from megaloop.runtime.stop import run_interruptible

    # SIGTERM (slurm, timeout) stops the worker pool and removes the temporary files, as Ctrl-C does
    return run_interruptible(_convert, argv, "txt360_to_mds")


def _convert(argv: list[str] | None) -> int:
    args = parse_args(argv)
    from megaloop.data.errors import DataError
    from megaloop.data.mds_convert import ConvertConfig, convert_txt360
    from megaloop.data.txt360 import HoldoutSpec, MixSpec

    try:
        tokenizer = args.tokenizer
        if tokenizer == "default":
            from megaloop.data.default_tokenizer import ensure_default_tokenizer

            tokenizer = str(ensure_default_tokenizer())
        cfg = ConvertConfig(
            input=Path(args.input), out=Path(args.out), tokenizer=tokenizer, packing=args.packing,
            seq_len=args.seq_len, workers=args.workers, seed=args.seed,
            mix=MixSpec.from_args(args.weights, args.source_weights, args.bucket_upsample),
            holdout=HoldoutSpec(args.val_fraction, args.screen_fraction, args.holdout_salt),
            sources=args.sources.split(",") if args.sources else None, eos_token=args.eos_token,
            compression=None if args.compression == "none" else args.compression,
            shard_size_limit=args.shard_size, progress=not args.no_progress, overwrite=args.overwrite,
            command=shlex.join([sys.executable, *sys.argv]))
        manifest = convert_txt360(cfg)
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:
        from megaloop.runtime.stop import interrupt_exit

        how, code = interrupt_exit(err)
        print(f"{how}: finished parts are kept; rerun the same command to resume", file=sys.stderr)
        return code
    except Exception as err:  # a full disk: one line (it was a traceback), else the traceback
        from megaloop.runtime.files import report_storage_full

        return report_storage_full(err)
    run = manifest.pop("_run")
    summary = {k: manifest.get(k) for k in ("total_tokens", "num_sequences", "dropped_tokens",
                                            "pad_tokens", "packing", "vocab_size", "eos_id",
                                            "source_tokens")}
    print(json.dumps(summary | {"parts": run["parts_total"], "parts_skipped": run["parts_skipped"],
                                "seconds": round(run["seconds"], 2), "out": str(args.out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
