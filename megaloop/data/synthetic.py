"""Synthetic MDS token datasets with recoverable sample ids (tests and loader benchmarks)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from megaloop.data._fsutil import atomic_write_json, json_sha
from megaloop.data.mds_convert import FORMAT, mds_columns, token_dtype, write_sequences_mds

ID_TOKENS = 3  # the first 3 tokens of row i encode i in base (vocab_size - 1), offset by 1


def encode_ids(ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """Sample ids [n] -> id tokens [n, 3] (never the EOS id 0)."""
    base = vocab_size - 1
    return np.stack([ids // base**2 % base, ids // base % base, ids % base], axis=1) + 1


def decode_ids(tokens: np.ndarray, vocab_size: int) -> np.ndarray:
    """Rows [n, >=3] -> the sample ids encoded in their first 3 tokens."""
    base = vocab_size - 1
    t = np.asarray(tokens)[:, :ID_TOKENS].astype(np.int64) - 1
    return t[:, 0] * base**2 + t[:, 1] * base + t[:, 2]


def write_synthetic_mds(out: str | Path, num_sequences: int, seq_len: int, *,
                        vocab_size: int = 4096, seed: int = 0, compression: str | None = "zstd",
                        doc_len: int = 200, size_limit: int = 1 << 26) -> dict:
    """Write ``num_sequences`` rows of ``seq_len`` random tokens (EOS=0 every ~``doc_len``).

    Row ``i`` starts with ``encode_ids(i)``. Writes ``out/index.json``, shards and
    ``out/manifest.json``; returns the manifest.
    """
    out = Path(out)
    if (out / "manifest.json").is_file():
        import json

        return json.loads((out / "manifest.json").read_text())
    rng = np.random.default_rng(seed)
    toks = rng.integers(1, vocab_size, size=(num_sequences, seq_len), dtype=np.int64)
    toks[rng.random(toks.shape) < 1.0 / doc_len] = 0
    toks[:, :ID_TOKENS] = encode_ids(np.arange(num_sequences), vocab_size)
    dtype = token_dtype(vocab_size)
    write_sequences_mds(out, toks.astype(dtype), "synthetic", compression=compression,
                        size_limit=size_limit)
    manifest = {
        "format": FORMAT, "kind": "synthetic", "seq_len": seq_len, "vocab_size": vocab_size,
        "eos_id": 0, "columns": mds_columns(seq_len, dtype), "total_tokens": int(toks.size),
        "num_sequences": num_sequences, "source_tokens": {"synthetic": int(toks.size)},
        "compression": compression, "seed": seed,
        "fingerprint": json_sha(["synthetic", num_sequences, seq_len, vocab_size, seed, compression]),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    atomic_write_json(out / "manifest.json", manifest)
    return manifest
