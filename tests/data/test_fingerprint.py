"""Content fingerprint of an MDS dataset (megaloop/data/fingerprint.py): equal for two builds of the
same tokens, different for other tokens, file hashes where the index records none."""

from __future__ import annotations

import json

import numpy as np

from megaloop.data import fingerprint as fp
from megaloop.data.mds_convert import write_sequences_mds


def _write(path, seed: int, n: int = 64):
    toks = np.random.default_rng(seed).integers(1, 500, size=(n, 16)).astype(np.uint16)
    write_sequences_mds(path, toks, "s", size_limit=1 << 10)  # several shards
    return path


def test_same_tokens_same_fingerprint_other_tokens_other(tmp_path) -> None:
    a, b, c = _write(tmp_path / "a", 1), _write(tmp_path / "b", 1), _write(tmp_path / "c", 2)
    fa, fb, fc = fp.content_fingerprint(a), fp.content_fingerprint(b), fp.content_fingerprint(c)
    assert fa["shards"] > 1 and fa["samples"] == 64 and fa["hashed"]
    assert fa == fb and fa["sha256"] != fc["sha256"]
    assert fp.content_fingerprint(tmp_path / "none") is None
    assert fp.content_fingerprint("s3://bucket/data") is None


def test_shards_without_recorded_hashes_are_read(tmp_path, monkeypatch) -> None:
    def strip(path):
        idx = json.loads((path / "index.json").read_text())
        for s in idx["shards"]:
            for part in ("raw_data", "zip_data"):
                if s.get(part):
                    s[part].pop("hashes", None)
        (path / "index.json").write_text(json.dumps(idx))
        return path

    a, b, c = strip(_write(tmp_path / "a", 1)), strip(_write(tmp_path / "b", 1)), strip(_write(tmp_path / "c", 2))
    assert fp.content_fingerprint(a) == fp.content_fingerprint(b)
    assert fp.content_fingerprint(a)["sha256"] != fp.content_fingerprint(c)["sha256"]
    monkeypatch.setattr(fp, "HASH_LIMIT_BYTES", 0)  # too large to read: sizes and counts only
    assert fp.content_fingerprint(a)["hashed"] is False
