"""Damaged MDS shards: named before anything is built, never reused from the cache, never a hang.

Before: a shard with bytes overwritten (size kept) passed the loader's checks and failed at the first
batch, after the model was built and the run directory written, as a streaming traceback naming only
the cache copy ("Checksum failure: $MEGALOOP_CACHE/streaming/<key>/slot0/...", then "Background thread
failed"); the damaged copy stayed in the cache slot, so the run failed again after the shard was
restored; and a reader waiting for a shard whose copy failed waited for ever.
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from megaloop.config_utils import ConfigError
from megaloop.data import DataConfig, DataError, build_eval_loader, build_train_loader
from megaloop.data.synthetic import write_synthetic_mds

SEQ = 32


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("integrity") / "ds"
    write_synthetic_mds(out, num_sequences=96, seq_len=SEQ, vocab_size=512, size_limit=1 << 12)
    return out


@pytest.fixture
def data(good, tmp_path) -> Path:
    copy = tmp_path / "data"
    shutil.copytree(good, copy)
    return copy


def _first_shard(root: Path) -> Path:
    return root / json.loads((root / "index.json").read_text())["shards"][0]["zip_data"]["basename"]


def _damage(f: Path, at: int = 40) -> None:
    """Overwrite 16 bytes inside ``f``, keeping its size (what the audit did)."""
    b = bytearray(f.read_bytes())
    b[at:at + 16] = bytes(255 - x for x in b[at:at + 16])
    f.write_bytes(bytes(b))


def _loader(path: Path, workers: int = 0, **kw):
    return build_train_loader(DataConfig(path=str(path), num_workers=workers, **kw), seq_len=SEQ,
                              micro_batch_size=4, dp_rank=0, dp_size=1, seed=0)


def _take(loader, n: int = 30) -> int:
    try:
        return len(list(itertools.islice(iter(loader), n)))
    finally:
        loader.close()


def test_a_damaged_shard_is_named_before_the_loader_is_built(data, good):
    """Before: accepted (sizes match); the failure came at the first batch, naming the cache copy."""
    shard = _first_shard(data)
    _damage(shard)
    for build in (lambda: _loader(data),
                  lambda: build_eval_loader(data, seq_len=SEQ, micro_batch_size=4, dp_rank=0, dp_size=1)):
        with pytest.raises(DataError, match=rf"MDS shard {shard} is corrupt: .*{data / 'index.json'}"):
            build()
    _loader(data, validate_hash=False).close()  # data.validate_hash=false: not read up front
    from megaloop.data.streaming import verify_dataset  # for a set read only later (data.val_path)

    with pytest.raises(DataError, match=f"MDS shard {shard} is corrupt"):
        verify_dataset(str(data))
    verify_dataset(str(data), validate_hash=False)
    verify_dataset("s3://bucket/data")  # remote: checked as shards are copied
    shutil.copy2(_first_shard(good), shard)  # restored: accepted, and remembered as verified
    assert _take(_loader(data)) == 30
    _damage(shard, at=100)  # damaged again after it was verified: its mtime changed, so read again
    with pytest.raises(DataError, match=f"MDS shard {shard} is corrupt"):
        _loader(data)


def test_processes_of_a_job_share_the_hashing_and_the_list_of_verified_shards(data, tmp_path, monkeypatch):
    """``part=(i, n)``: each of n processes reads every n-th shard; what each verified is merged into
    the one list, so a later check by a single process reads nothing again."""
    from megaloop.data import integrity

    read: list[str] = []
    real = integrity.xxh64_file
    monkeypatch.setattr(integrity, "xxh64_file", lambda f: read.append(f.name) or real(f))
    index = json.loads((data / "index.json").read_text())
    names = [s["zip_data"]["basename"] for s in index["shards"]]
    cache = tmp_path / "cache"
    assert len(names) == 3
    integrity.verify_shard_hashes(data, index, cache, part=(1, 3))
    assert read == names[1::3]
    integrity.verify_shard_hashes(data, index, cache, part=(0, 3))
    integrity.verify_shard_hashes(data, index, cache, part=(2, 3))
    assert sorted(read) == sorted(names)
    read.clear()
    integrity.verify_shard_hashes(data, index, cache)
    assert read == []
    _damage(data / names[2])  # in the share of process 2 of 3 only
    integrity.verify_shard_hashes(data, index, cache, part=(0, 3))
    with pytest.raises(DataError, match=f"MDS shard {data / names[2]} is corrupt"):
        integrity.verify_shard_hashes(data, index, cache, part=(2, 3))
    with pytest.raises(ValueError, match="part"):
        integrity.verify_shard_hashes(data, index, cache, part=(3, 3))


def test_a_damaged_copy_left_in_the_cache_is_copied_again(data):
    """Before: the damaged copy in the cache slot was reused by every later run ("Checksum failure"),
    even with the shard itself intact."""
    lo = _loader(data)
    slot = Path(lo._ds.streams[0].local)
    lo.close()
    copy = slot / _first_shard(data).name
    shutil.copyfile(_first_shard(data), copy)
    _damage(copy)  # what a failed copy leaves (streaming deletes a good one once unpacked)
    assert _take(_loader(data)) == 30  # the slot is refreshed when taken
    # a copy damaged after the slot was taken fails its check once and is copied again
    for raw in slot.glob("*.mds"):
        raw.unlink()
    lo = _loader(data)
    shutil.copyfile(_first_shard(data), copy)
    _damage(copy)
    assert _take(lo) == 30
    from megaloop.data.integrity import refresh_cache_slot

    shutil.copyfile(_first_shard(data), copy)
    _damage(copy)
    index = json.loads((data / "index.json").read_text())
    assert refresh_cache_slot(slot, index, data) == [copy]
    assert refresh_cache_slot(slot, index, data) == []


@pytest.mark.parametrize("workers", [0, 2])
def test_a_shard_damaged_while_streaming_is_one_data_error(data, workers):
    """Before: a traceback from streaming's download thread naming the cache copy, then
    "RuntimeError: Background thread failed" (or a worker's traceback with num_workers > 0)."""
    lo = _loader(data, workers)  # verified here, damaged before its first copy
    shard = _first_shard(data)
    _damage(shard)
    with pytest.raises(DataError) as err:
        _take(lo, 48)
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"MDS shard {shard} is corrupt") and "cache" in text
    slot = Path(lo._ds.streams[0].local)
    assert not (slot / shard.name).exists()  # the damaged copy is not kept for the next run


def test_warm_reads_the_first_batch_without_moving_the_data_position(data):
    """``TrainLoader.warm()`` (for a trainer to call before it writes its run directory): a shard
    that cannot be read fails there; otherwise the batches and the resume state are unchanged."""
    import torch

    ref = _loader(data)
    want = list(itertools.islice(iter(ref), 5))
    ref.close()
    lo = _loader(data)
    fresh = lo.state_dict()
    lo.warm()
    assert lo.state_dict() == fresh
    got = list(itertools.islice(iter(lo), 5))
    assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(got, want))
    assert lo.state_dict()["sample_in_epoch"] == 5 * 4
    lo.close()
    bad = data.parent / "bad"  # nothing of it in the cache yet
    shutil.copytree(data, bad)
    lo = _loader(bad)
    for shard in bad.glob("*.mds.zstd"):  # whichever shard the first batch reads
        _damage(shard)
    with pytest.raises(DataError, match=rf"MDS shard {bad}/shard\.\d+\.mds\.zstd is corrupt"):
        lo.warm()
    lo.close()


def test_a_failed_copy_wakes_the_reader_waiting_for_it(data, monkeypatch):
    """Before: streaming left the shard PREPARING after its copy failed in one thread, and a reader
    waiting for it in another (the trainer's first batch) slept for ever; Ctrl-C did not end it."""
    lo = _loader(data)
    ds = lo._ds
    stream = ds.streams[0]
    real = stream._decompress_shard_part

    def slow_and_bad(zip_info, zip_filename, raw_filename, compression):
        time.sleep(0.5)
        raise ValueError(f"Checksum failure: {zip_filename}")

    monkeypatch.setattr(stream, "_decompress_shard_part", slow_and_bad)
    results: dict = {}

    def run(name, fn):
        try:
            results[name] = fn()
        except BaseException as e:  # noqa: BLE001
            results[name] = e

    copier = threading.Thread(target=run, args=("copier", lambda: ds.prepare_shard(0, False)), daemon=True)
    copier.start()
    time.sleep(0.2)  # the copier holds shard 0 (PREPARING); the reader waits for it
    reader = threading.Thread(target=run, args=("reader", lambda: ds.get_item(0)), daemon=True)
    reader.start()
    reader.join(30)
    copier.join(30)
    assert not reader.is_alive(), "the reader still waits for the failed shard"
    assert isinstance(results["reader"], DataError) and "is corrupt" in str(results["reader"])
    monkeypatch.setattr(stream, "_decompress_shard_part", real)
    lo.close()


def test_a_copy_failed_in_another_worker_process_ends_this_ones_wait(data):
    """Before: a worker whose ready thread waited for a shard that another worker process was copying
    waited for ever when that copy failed (it watches only its own process' stop event, and the state
    went back to REMOTE); the failing process now leaves a mark in the cache slot that every process
    of the loader watches, and a new loader on the slot starts clean."""
    from streaming.base.dataset import _ShardState

    from megaloop.data.streaming import FAILURE_MARK

    lo = _loader(data)
    ds = lo._ds
    slot = Path(ds.streams[0].local)
    for i in range(len(ds.shards)):  # as if another worker process were copying every shard
        ds._shard_states[i] = _ShardState.PREPARING
    results: dict = {}

    def take():
        try:
            results["got"] = next(iter(lo))
        except BaseException as e:  # noqa: BLE001
            results["got"] = e

    reader = threading.Thread(target=take, daemon=True)
    reader.start()
    time.sleep(1.0)
    assert reader.is_alive()  # waiting for the other process' copy
    (slot / FAILURE_MARK).write_text("MDS shard X could not be copied into the cache: OSError: boom")
    reader.join(20)
    assert not reader.is_alive(), "the reader still waits for the shard another process failed to copy"
    assert isinstance(results["got"], DataError) and str(results["got"]).startswith("MDS shard X could not be copied")
    lo.close()
    assert _take(_loader(data)) == 30  # the slot's next loader: the mark is cleared, the shards copied


def test_the_epoch_ends_after_its_download_threads_failed(data, monkeypatch):
    """Before: a download thread that raised was never counted as exited, so the end of the epoch
    (``_Iterator.exit``, also run when the loader is closed at exit) waited for ever: the trainer hung
    at its first batch, and neither Ctrl-C nor SIGTERM ended it."""
    import numpy as np
    from streaming.base.dataset import _Iterator

    lo = _loader(data)
    ds = lo._ds

    def bad(zip_info, zip_filename, raw_filename, compression):
        raise ValueError(f"Checksum failure: {zip_filename}")

    monkeypatch.setattr(ds.streams[0], "_decompress_shard_part", bad)
    ds._event = threading.Event()
    it = _Iterator(np.arange(8))
    with pytest.raises(DataError, match="is corrupt"):
        ds._ready_thread(it)  # it copies a shard it finds REMOTE itself: the copy fails, so it raises
    ds._prepare_thread(it)  # told to stop by the failure
    ender = threading.Thread(target=it.exit, daemon=True)
    ender.start()
    ender.join(20)
    assert not ender.is_alive(), "the end of the epoch still waits for the failed threads"
    lo.close()


def test_copy_failures_are_named_by_their_cause(data):
    """What a shard copy can fail with, as one DataError naming the shard (or the option to change);
    anything else (a bug) is left as it is."""
    from megaloop.data.streaming import _copy_failure

    lo = _loader(data)
    ds = lo._ds
    shard = _first_shard(data)
    ClientError = type("ClientError", (Exception,), {"__module__": "botocore.exceptions"})  # an object store's
    cases = {
        ClientError("An error occurred (AccessDenied)"): rf"^MDS shard {shard} could not be copied .*ClientError: "
                                                         r"An error occurred \(AccessDenied\)",
        OSError(28, "No space left on device"): rf"^MDS shard {shard} could not be copied .*No space left",
        ValueError("Attempted shard eviction, but there are no shards present locally to evict. Your cache "
                   "limit may be too low."): rf"^data\.cache_limit=.* too small to hold shard {shard}",
        ValueError("Hash algorithm `xxh64` chosen for data validation does not match with those provided "
                   "during dataset creation `[]`. Provide one of those."): rf"^data\.validate_hash: {shard} has no xxh64",
    }
    for err, pattern in cases.items():
        got = _copy_failure(ds, 0, err)
        assert isinstance(got, DataError) and re.search(pattern, str(got)), (err, got)
    bug = KeyError("shards")
    assert _copy_failure(ds, 0, bug) is bug
    lo.close()


def test_a_seq_len_mismatch_names_model_seq_len(good):
    """Before: "data.seq_len: ...", a field that does not exist (the model's is model.seq_len)."""
    with pytest.raises(ConfigError, match=rf"^model\.seq_len: the model uses seq_len=64 but .*manifest.json "
                                          rf"holds sequences of {SEQ} tokens; .*set model\.seq_len={SEQ}"):
        build_train_loader(DataConfig(path=str(good)), seq_len=64, micro_batch_size=2, dp_rank=0, dp_size=1,
                           seed=0)
    with pytest.raises(ConfigError, match=r"^seq_len: the evaluation reads sequences of seq_len=16 but"):
        build_eval_loader(good, seq_len=16, micro_batch_size=2, dp_rank=0, dp_size=1)


def test_train_with_a_damaged_shard_exits_2_before_the_run_directory(tmp_path):
    """Before: exit 1 after the model was built, a streaming traceback naming the cache copy, and the
    run directory (config.yaml, data.json, metrics.jsonl, tokenizer.json, lock) left behind."""
    from tests.train.helpers import run_train

    data = tmp_path / "data"
    write_synthetic_mds(data, num_sequences=64, seq_len=128, vocab_size=512, size_limit=1 << 13)
    shard = _first_shard(data)
    _damage(shard)
    run = tmp_path / "r1"
    proc = run_train(run, "train.max_steps=2", f"data.path={data}", expect=2, timeout=300)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and "warn" not in ln.lower()]
    assert len(lines) == 1 and f"MDS shard {shard} is corrupt" in lines[0], lines
    assert not run.exists()
    # without the up-front hash check, the first batch (read before the run directory) names the shard
    for other in data.glob("*.mds.zstd"):
        _damage(other)
    proc = run_train(run, "train.max_steps=2", f"data.path={data}", "data.validate_hash=false", expect=2,
                     timeout=300)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and "warn" not in ln.lower()]
    assert len(lines) == 1 and f"data.path={data}: MDS shard {data}/shard." in lines[0], lines
    assert not run.exists()
    # a damaged validation set (read only at the first evaluation) is named before the run directory too
    good = tmp_path / "good"
    write_synthetic_mds(good, num_sequences=64, seq_len=128, vocab_size=512, size_limit=1 << 13)
    proc = run_train(run, "train.max_steps=2", f"data.path={good}", f"data.val_path={data}", expect=2,
                     timeout=300)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and "warn" not in ln.lower()]
    assert len(lines) == 1 and re.search(rf"data\.val_path={data}: MDS shard {data}/shard\.\d+\.mds\.zstd is corrupt",
                                         lines[0]), lines
    assert not run.exists()


def test_two_ranks_stop_together_naming_the_rank_that_found_the_damage(tmp_path):
    """Each rank hashes its share of the shards; a damaged shard in rank 1's share stops both ranks
    with the same line (before: every rank hashed every shard; a rank that failed alone left the other
    waiting in a collective until torchrun ended it, after rank 0 wrote the run directory)."""
    from tests.conftest import ROOT
    from tests.train.helpers import env, train_cmd

    data = tmp_path / "data"
    write_synthetic_mds(data, num_sequences=64, seq_len=128, vocab_size=512, size_limit=1 << 13)
    names = [s["zip_data"]["basename"] for s in json.loads((data / "index.json").read_text())["shards"]]
    _damage(data / names[1])  # shards[1::2]: rank 1's share
    run = tmp_path / "r2"
    proc = subprocess.run(train_cmd(run, "train.max_steps=2", f"data.path={data}", nproc=2), cwd=ROOT,
                          env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    found = re.findall(r"data\.path=\S+: MDS shard (\S+) is corrupt: .*\(found by rank (\d)\)", proc.stderr)
    assert found and set(found) == {(str(data / names[1]), "1")}, proc.stderr[-3000:]
    assert not run.exists()
    # without the hash check, the first batch fails on a rank: every rank stops with its line, no run dir
    proc = subprocess.run(train_cmd(run, "train.max_steps=2", f"data.path={data}", "data.validate_hash=false",
                                    nproc=2), cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    lines = re.findall(r"error \(rank (\d)\): data\.path=\S+: (MDS shard \S+ could not be copied .*)", proc.stderr)
    assert proc.returncode != 0 and sorted(r for r, _ in lines) == ["0", "1"], proc.stderr[-3000:]
    assert len({text for _, text in lines}) == 1 and "(found by rank" in lines[0][1]
    assert not run.exists()


def test_a_damaged_unpacked_copy_is_dropped_when_hashes_are_checked(data):
    """An unpacked copy in the cache slot was checked by its size alone: one with flipped bytes was
    trained on silently (other losses, no word), and a badly damaged one failed every later run
    blaming the intact source shard. With data.validate_hash (the default) it is hashed against the raw
    xxh64 of index.json once per size and mtime, and dropped when it differs."""
    from megaloop.data.integrity import refresh_cache_slot

    lo = _loader(data)
    _take(lo, 96 // 4)
    slot = Path(lo._ds.streams[0].local)
    lo.close()
    raws = sorted(slot.glob("*.mds"))
    assert raws, sorted(p.name for p in slot.iterdir())
    index = json.loads((data / "index.json").read_text())
    assert refresh_cache_slot(slot, index, data, check_raw=True) == []
    memo = json.loads((slot / ".megaloop-verified.json").read_text())
    assert sorted(memo) == sorted(p.name for p in raws)  # each hashed once, then listed
    _damage(raws[0])  # same size: the size check alone keeps it
    assert refresh_cache_slot(slot, index, data, check_raw=False) == []
    assert refresh_cache_slot(slot, index, data, check_raw=True) == [raws[0]]
    assert raws[0].name not in json.loads((slot / ".megaloop-verified.json").read_text())
    assert _take(_loader(data)) == 30  # copied again from the intact shard
