#!/usr/bin/env python
"""Train a byte-level BPE tokenizer on (a sample of) a TxT360 tree.

    python data_prep/train_tokenizer.py --input ROOT --out DIR [--vocab-size 32768] [--max-docs N]

Writes ``DIR/tokenizer.json`` plus HF ``tokenizer_config.json`` / ``special_tokens_map.json``
(EOS ``<|endoftext|>`` = 0, BOS ``<|bos|>`` = 1, PAD ``<|pad|>`` = 2), loadable by
``megaloop.data.load_tokenizer`` and ``transformers.PreTrainedTokenizerFast``. Documents are
read in sorted file order (deterministic); ``--max-docs`` caps how many are used.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, help="TxT360 root (holding data/) or its data/ dir")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--vocab-size", type=int, default=32768)
    p.add_argument("--max-docs", type=int, default=1_000_000)
    args = p.parse_args(argv)
    from megaloop.data.errors import DataError
    from megaloop.data.tokenizer import Tokenizer, train_bytelevel_bpe
    from megaloop.data.txt360 import discover, read_jsonl

    try:
        files = discover(args.input)
        texts = (t for f in files for _, t in read_jsonl(f.path))
        path = train_bytelevel_bpe(itertools.islice(texts, args.max_docs), args.out,
                                   vocab_size=args.vocab_size)
        tok = Tokenizer(path)
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {Path(path)} (vocab {tok.vocab_size}, eos {tok.eos_id}, sha256 {tok.sha256[:12]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
