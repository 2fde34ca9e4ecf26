"""Datasets the loaders used to accept and then fail on with a traceback (a data-loading audit): an empty
set (a validation set crashed at the first evaluation), token ids outside the vocabulary (an IndexError in
the embedding), a sample that does not decode with the hash check off, an unusable cache folder, and MDS
folders without megaloop's manifest named as an unfinished conversion."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from megaloop.config_utils import ConfigError
from megaloop.data import DataConfig, DataError, build_train_loader
from megaloop.data.dataset_checks import check_cache_dir
from megaloop.data.streaming import load_manifest
from megaloop.data.synthetic import write_synthetic_mds

SEQ = 32


def _loader(path: Path, **kw):
    return build_train_loader(DataConfig(path=str(path), num_workers=0, **kw), seq_len=SEQ, micro_batch_size=4,
                              dp_rank=0, dp_size=1, seed=7)


def _edit(path: Path, **fields) -> None:
    data = json.loads(path.read_text())
    data.update(fields)
    path.write_text(json.dumps(data))


def test_an_empty_dataset_is_refused_when_the_loader_is_built(tmp_path):
    d = tmp_path / "empty"
    write_synthetic_mds(d, num_sequences=8, seq_len=SEQ, vocab_size=512)
    _edit(d / "index.json", shards=[])
    with pytest.raises(DataError, match=rf"^dataset {d} is empty: {d / 'index.json'} lists no samples$"):
        _loader(d)


def test_token_ids_outside_the_manifests_vocabulary_are_named(tmp_path):
    d = tmp_path / "big_ids"
    write_synthetic_mds(d, num_sequences=16, seq_len=SEQ, vocab_size=512)
    _edit(d / "manifest.json", vocab_size=100)  # ids reach 511
    with pytest.raises(DataError, match=rf"^dataset {d}: token id \d+ outside the vocabulary \[0, 100\) its "
                                        r"manifest.json records \(vocab_size\)"):
        next(iter(_loader(d)))


@pytest.mark.parametrize("workers", [0, 1])
def test_a_sample_that_does_not_decode_names_the_shard_with_the_hash_check_off(tmp_path, workers):
    d = tmp_path / "raw"
    write_synthetic_mds(d, num_sequences=16, seq_len=SEQ, vocab_size=512, compression=None)
    shard = next(d.rglob("*.mds"))
    data = shard.read_bytes()
    assert b"synthetic" in data  # the rows' source column
    shard.write_bytes(data.replace(b"synthetic", b"\xffynthetic"))
    loader = build_train_loader(DataConfig(path=str(d), num_workers=workers, validate_hash=False), seq_len=SEQ,
                                micro_batch_size=4, dp_rank=0, dp_size=1, seed=7)
    with pytest.raises(DataError, match=rf"MDS shard {shard}: sample \d+ cannot be decoded \(UnicodeDecodeError"):
        next(iter(loader))


def test_an_unusable_cache_folder_is_named(tmp_path, monkeypatch):
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match=rf"^data.cache_dir: {tmp_path / 'f' / 'c'}: {tmp_path / 'f'} is not a directory$"):
        check_cache_dir(str(tmp_path / "f" / "c"))
    monkeypatch.setenv("MEGALOOP_CACHE", "/proc/megaloop-cache")
    with pytest.raises(ConfigError, match=r"^\$MEGALOOP_CACHE: /proc/megaloop-cache: no file can be created in /proc"):
        check_cache_dir(None)
    check_cache_dir(str(tmp_path / "new" / "cache"))  # a folder that can be created is fine
    # a loader checks the cache only where it uses it: compressed (or remote) shards and the embedded corpus
    raw, packed = tmp_path / "raw", tmp_path / "packed"
    write_synthetic_mds(raw, num_sequences=16, seq_len=SEQ, vocab_size=512, compression=None)
    write_synthetic_mds(packed, num_sequences=16, seq_len=SEQ, vocab_size=512)
    assert next(iter(_loader(raw, cache_dir=str(tmp_path / "f"))))["tokens"].shape == (4, SEQ)
    with pytest.raises(ConfigError, match=rf"^data.cache_dir: {tmp_path / 'f'}: exists and is not a directory$"):
        _loader(packed, cache_dir=str(tmp_path / "f"))
    with pytest.raises(ConfigError, match=rf"^data.cache_dir: {tmp_path / 'f'}: exists and is not a directory$"):
        _loader("default", cache_dir=str(tmp_path / "f"))


def test_folders_without_a_manifest_are_told_apart(tmp_path):
    ds = tmp_path / "ds"
    write_synthetic_mds(ds, num_sequences=8, seq_len=SEQ, vocab_size=512)
    foreign = tmp_path / "foreign"  # an MDS set another tool wrote: index.json, no manifest.json
    shutil.copytree(ds, foreign)
    (foreign / "manifest.json").unlink()
    with pytest.raises(DataError, match="an MDS set without megaloop's manifest.json"):
        load_manifest(str(foreign))
    unfinished = tmp_path / "unfinished"  # the converter's output before its manifest: parts/ and an index
    shutil.copytree(foreign, unfinished)
    (unfinished / "parts").mkdir()
    with pytest.raises(DataError, match="index.json exists: the conversion did not finish; rerun it"):
        load_manifest(str(unfinished))
    part = ds / "parts" / "a"  # one part folder of a finished conversion
    part.mkdir(parents=True)
    (part / "index.json").write_text("{}")
    with pytest.raises(DataError, match=rf"it is one part of the dataset {ds}: give that folder"):
        load_manifest(str(part))
    held = tmp_path / "eval_sets"  # build_eval_sets.py's --out: val/ and screen/
    for sub in ("val", "screen"):
        shutil.copytree(ds, held / sub)
    with pytest.raises(DataError, match=rf"it holds the held-out sets {held / 'val'}, {held / 'screen'}: give one"):
        load_manifest(str(held))


@pytest.mark.parametrize("encoding", ["ndarray:float32:32", "ndarray:int32", "bytes", None])
def test_a_tokens_column_that_is_no_fixed_length_integer_array_is_named(tmp_path, encoding):
    """A set written by another tool with float tokens trained on them cast to int; rows without a fixed
    length trained at whatever length they had (or crashed in np.stack when ragged)."""
    d = tmp_path / "foreign"
    write_synthetic_mds(d, num_sequences=8, seq_len=SEQ, vocab_size=512)
    index = json.loads((d / "index.json").read_text())
    for shard in index["shards"]:
        cols = dict(zip(shard["column_names"], shard["column_encodings"]))
        if encoding is None:
            cols.pop("tokens")
        else:
            cols["tokens"] = encoding
        shard["column_names"], shard["column_encodings"] = list(cols), list(cols.values())
    (d / "index.json").write_text(json.dumps(index))
    with pytest.raises(DataError, match=rf"^MDS shard {d}/\S+ stores tokens as {encoding!r} .*megaloop reads "
                                        r"fixed-length integer rows"):
        _loader(d, validate_hash=False)
