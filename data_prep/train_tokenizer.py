#!/usr/bin/env python
"""Train a byte-level BPE tokenizer on (a sample of) a TxT360 tree.

    python data_prep/train_tokenizer.py --input ROOT --out DIR [--vocab-size 32768] [--max-docs N] [--overwrite]

Writes ``DIR/tokenizer.json`` plus HF ``tokenizer_config.json`` / ``special_tokens_map.json``
(EOS ``<|endoftext|>`` = 0, BOS ``<|bos|>`` = 1, PAD ``<|pad|>`` = 2), loadable by
``megaloop.data.load_tokenizer`` and ``transformers.PreTrainedTokenizerFast``. Documents are
read one source at a time in turn, each source's in sorted file order (deterministic), so
``--max-docs``, the cap, takes an equal share of every source; the count read per source is printed.

Refused before training (exit 2, one line naming the flag): ``--vocab-size`` not above the 256 byte
symbols + 3 special tokens (no merge would be learned), ``--max-docs`` < 1, an ``--out`` that is a
file, that cannot be created or written (probed with a temporary file) or that lies inside the input
tree's ``data/``. A tokenizer smaller than ``--vocab-size`` (too little text for more merges) is
named in a note on stderr. A ``tokenizer.json`` already in ``--out`` that differs from the new one is refused (nothing
written) unless ``--overwrite``: data converted with it, and runs trained on that data, name it by
its sha256. The files are trained into a folder beside ``--out`` and renamed into place, the
tokenizer.json last, so an interrupted run leaves ``--out`` as it was.
"""

from __future__ import annotations

import argparse
import glob
import itertools
import os
import shutil
import socket
import sys
from pathlib import Path

BYTE_ALPHABET = 256  # byte-level BPE: one symbol per byte value
FILES = ("special_tokens_map.json", "tokenizer_config.json", "tokenizer.json")  # tokenizer.json renamed last


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="TxT360 root (holding data/) or its data/ dir")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--vocab-size", type=int, default=32768,
                   help="tokens incl. the 256 byte symbols and 3 special tokens (so at least 260)")
    p.add_argument("--max-docs", type=int, default=1_000_000, help="documents read at most (>= 1)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a different tokenizer.json already in --out (refused otherwise)")
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """DataError naming the flag for arguments that cannot give a usable tokenizer."""
    from megaloop.data.errors import DataError
    from megaloop.data.tokenizer import SPECIAL_TOKENS

    floor = BYTE_ALPHABET + len(SPECIAL_TOKENS)
    if args.vocab_size <= floor:
        raise DataError(f"--vocab-size must be > {floor} (the {BYTE_ALPHABET} byte symbols and "
                        f"{len(SPECIAL_TOKENS)} special tokens leave no room for a merge), got {args.vocab_size}")
    if args.max_docs < 1:
        raise DataError(f"--max-docs must be >= 1, got {args.max_docs}")
    from megaloop.data._fsutil import check_out_writable

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} is a file, not a directory")
    check_out_writable(out)  # --out, or the folder above it where it and the training folder are made
    if (out / "tokenizer.json").exists() and not (out / "tokenizer.json").is_file():
        raise DataError(f"--out {out}: {out / 'tokenizer.json'} is not a file")


def publish(tmp: Path, out: Path, overwrite: bool, shown: str | Path | None = None) -> None:
    """Move the files trained into ``tmp`` into ``out`` (tokenizer.json last); a different
    tokenizer.json already there is refused (DataError naming both sha256) unless ``overwrite``."""
    from megaloop.data.errors import DataError
    from megaloop.data.tokenizer import file_sha256

    old = out / "tokenizer.json"
    if old.is_file() and not overwrite:
        have, new = file_sha256(old), file_sha256(tmp / "tokenizer.json")
        if have != new:
            raise DataError(f"--out {shown or out} already holds a different tokenizer.json (sha256 {have[:12]}…, "
                            f"the new one {new[:12]}…): data converted with it names it by that sha256; pass "
                            f"--overwrite to replace it, or choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        os.replace(tmp / name, out / name)


def interleave_sources(files, read_jsonl, counts: dict[str, int]):
    """The documents of ``files`` one source at a time in turn (each source's in sorted file order),
    so that ``--max-docs`` takes an equal share of every source (a source that runs out leaves its
    share to the others); ``counts``: documents taken per source. It read the sorted files in turn,
    so a capped run on a TxT360 tree trained on its first source(s) alone."""
    streams: dict[str, list] = {}
    for f in files:
        streams.setdefault(f.source, []).append(f)
    live = {src: (t for f in fs for _, t in read_jsonl(f.path)) for src, fs in streams.items()}
    counts.update(dict.fromkeys(live, 0))
    while live:
        for src in list(live):
            text = next(live[src], _END)
            if text is _END:
                del live[src]
                continue
            counts[src] += 1
            yield text


_END = object()


def main(argv: list[str] | None = None) -> int:
    from megaloop.runtime.stop import run_interruptible

    # SIGTERM (slurm, timeout) takes the interrupt path, as Ctrl-C does (it killed the run without a word)
    return run_interruptible(_train, argv, "train_tokenizer")


def _train(argv: list[str] | None) -> int:
    args = parse_args(argv)
    from megaloop.data.errors import DataError
    from megaloop.data.tokenizer import Tokenizer, train_bytelevel_bpe
    from megaloop.data.txt360 import check_out_outside_input, discover, read_jsonl

    out = Path(os.path.abspath(args.out))
    host = socket.gethostname()
    tmp = out.parent / f".{out.name}.train_tokenizer-tmp-{host}-{os.getpid()}"
    stem = f".{out.name}.train_tokenizer-tmp-{host}-"
    for stale in out.parent.glob(glob.escape(stem) + "*"):  # a killed run's, on this host, its process gone
        pid = stale.name[len(stem):]
        if pid.isdigit() and Path("/proc/self").is_dir() and not Path(f"/proc/{pid}").exists() and stale != tmp:
            shutil.rmtree(stale, ignore_errors=True)
    from megaloop.data._fsutil import first_missing

    created = first_missing(out.parent)  # folders above --out this run creates: removed again on failure
    path, ok = out / "tokenizer.json", False
    try:
        check_args(args)
        files = discover(args.input)
        check_out_outside_input(args.input, args.out)
        per_source: dict[str, int] = {}
        texts = itertools.islice(interleave_sources(files, read_jsonl, per_source), args.max_docs)
        read = [0]

        def counted():
            for text in texts:
                read[0] += 1
                yield text

        from megaloop.runtime.stop import sigterm_default

        with sigterm_default():  # the merges run in Rust: a handler would wait for them; the next run removes tmp
            train_bytelevel_bpe(counted(), tmp, vocab_size=args.vocab_size)
        if not read[0]:
            raise DataError(f"--input {args.input}: no documents to train on")
        publish(tmp, out, args.overwrite, args.out)
        tok = Tokenizer(path)
        ok = True
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"error: {err.filename or args.out}: {err.strerror or err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:
        from megaloop.runtime.stop import interrupt_exit

        how, code = interrupt_exit(err)
        print(f"{how}: --out {args.out} is as it was", file=sys.stderr)
        return code
    except Exception as err:  # a full disk: one line (it was a traceback), else the traceback
        from megaloop.runtime.files import report_storage_full

        return report_storage_full(err)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if created is not None and not ok:
            shutil.rmtree(created, ignore_errors=True)
    if tok.vocab_size < args.vocab_size:
        print(f"note: --vocab-size {args.vocab_size}: the tokenizer has {tok.vocab_size} tokens (no other pair of "
              f"tokens occurs twice in the {read[0]:,} document(s) read; more text gives more)", file=sys.stderr)
    print(f"read {read[0]:,} document(s): " + ", ".join(f"{src} {n:,}" for src, n in per_source.items()))
    print(f"wrote {Path(args.out) / 'tokenizer.json'} (vocab {tok.vocab_size}, eos {tok.eos_id}, "
          f"sha256 {tok.sha256[:12]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
