"""TxT360 file discovery on the published layout (a CommonCrawl dump level above the buckets)."""

import gzip
import json

from megaloop.data.txt360 import NO_BUCKET, discover, read_jsonl


def _write(path, texts, gz=False):
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps({"text": t, "meta": {"n": i}}) + "\n" for i, t in enumerate(texts))
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(lines)
    else:
        path.write_text(lines)


def test_published_layout_with_dump_level(tmp_path):
    root = tmp_path / "TxT360"
    _write(root / "data/common-crawl/CC-MAIN-2013-20/1-1/chunk_000_0000.jsonl.gz", ["a", "b"], gz=True)
    _write(root / "data/common-crawl/CC-MAIN-2013-48/2-5/chunk_000_0001.jsonl.gz", ["c"], gz=True)
    _write(root / "data/arxiv/11-100/0_0.jsonl", ["d"])
    _write(root / "data/wiki/en/extra.jsonl", ["e"])  # no bucket directory
    found = {f.part: (f.source, f.bucket) for f in discover(root)}
    assert found == {
        "common-crawl/CC-MAIN-2013-20/1-1/chunk_000_0000": ("common-crawl", "1-1"),
        "common-crawl/CC-MAIN-2013-48/2-5/chunk_000_0001": ("common-crawl", "2-5"),
        "arxiv/11-100/0_0": ("arxiv", "11-100"),
        "wiki/en/extra": ("wiki", NO_BUCKET),
    }
    cc = next(f for f in discover(root, sources=["common-crawl"]) if f.bucket == "1-1")
    assert [t for _, t in read_jsonl(cc.path)] == ["a", "b"]


def test_lines_split_at_newline_only(tmp_path):
    """JSON Lines separates records by \\n; a bare \\r is JSON whitespace. Universal newlines split
    `{"text": "a",\\r "meta": {}}` in two and refused a valid record (line numbers after it were off by one)."""
    for gz in (False, True):
        path = tmp_path / ("x.jsonl.gz" if gz else "x.jsonl")
        data = b'{"text": "a",\r "meta": {}}\r\n{"text": "b\\r\\nc"}\n\n{"text": "d"}\n'
        path.write_bytes(gzip.compress(data) if gz else data)
        assert list(read_jsonl(path)) == [(1, "a"), (2, "b\r\nc"), (4, "d")]


def test_fractional_copies_are_chosen_per_document_not_per_file():
    """`round(frac(m)·n)` extra copies per file: a source of one-document files at weight 0.4 got no copy
    at all (it vanished from the mix) and 1.5 gave one copy per document (an audit: 0 and 483 tokens
    where 193 and 724 were due). Per document the choice is the same however files group documents."""
    import numpy as np

    from megaloop.data.txt360 import copies_per_doc, doc_rank_key

    keys = np.array([doc_rank_key(f"document {i}", seed=0) for i in range(4000)])
    for m in (0.4, 1.5, 2.5, 0.6, 3.0):
        whole = copies_per_doc(keys, m)
        singles = np.concatenate([copies_per_doc(keys[i:i + 1], m) for i in range(len(keys))])
        assert (whole == singles).all()
        assert abs(whole.mean() - m) < 0.03, (m, whole.mean())  # binomial sd ~0.008
        assert set(np.unique(whole)) <= {int(m), int(m) + 1}
    assert (copies_per_doc(keys, 3.0) == 3).all()


def test_common_crawls_top_bucket_is_the_top_bucket(tmp_path, capsys):
    """The release names Common Crawl's top duplicate bucket ``1001-30000000`` (the curated sources'
    ``1001-inf``): its files fell to bucket ``none`` (x1 where the bucket below got x5), with only a note,
    and ``--bucket-upsample 1001-30000000=5`` was refused as an unknown bucket. It is a bucket of its own,
    x5 by default like ``1001-inf``, and weighted apart from the curated sources' top bucket."""
    import pytest

    from megaloop.data.errors import DataError
    from megaloop.data.txt360 import MixSpec

    root = tmp_path / "TxT360"
    _write(root / "data/common-crawl/CC-MAIN-2016-36/1001-30000000/chunk_000_0000.jsonl.gz", ["a"], gz=True)
    _write(root / "data/common-crawl/CC-MAIN-2016-36/101-1000/chunk_000_0000.jsonl.gz", ["b"], gz=True)
    _write(root / "data/pubmed_central/1001-inf/0_1.jsonl", ["c"])
    found = {f.part: f.bucket for f in discover(root)}
    assert found == {"common-crawl/CC-MAIN-2016-36/1001-30000000/chunk_000_0000": "1001-30000000",
                     "common-crawl/CC-MAIN-2016-36/101-1000/chunk_000_0000": "101-1000",
                     "pubmed_central/1001-inf/0_1": "1001-inf"}
    assert "look like duplicate buckets" not in capsys.readouterr().err
    assert MixSpec().multiplier("common-crawl", found["common-crawl/CC-MAIN-2016-36/1001-30000000/chunk_000_0000"]) == 5.0
    mix = MixSpec.from_args(bucket_upsample="1001-30000000=0")  # drop Common Crawl's top bucket alone
    assert (mix.multiplier("common-crawl", "1001-30000000"), mix.multiplier("pubmed_central", "1001-inf")) == (0.0, 5.0)
    with pytest.raises(DataError, match=r"unknown bucket\(s\) \['1001-3000'\]"):
        MixSpec.from_args(bucket_upsample="1001-3000=3")


def test_a_git_lfs_pointer_is_named_as_one(tmp_path):
    """A clone without git-lfs leaves pointer files: a .jsonl.gz one was called "not gzip-compressed,
    rename it", and the renamed file "invalid JSON"."""
    import pytest

    from megaloop.data.errors import DataError

    pointer = "version https://git-lfs.github.com/spec/v1\noid sha256:" + "0" * 64 + "\nsize 123\n"
    for name in ("chunk.jsonl.gz", "0_1.jsonl"):
        (tmp_path / name).write_text(pointer)
        with pytest.raises(DataError, match=r"a Git LFS pointer, not the data .*`git lfs pull`"):
            list(read_jsonl(tmp_path / name))
