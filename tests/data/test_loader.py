"""Train/eval loaders: exact mid-epoch resume, DP sharding, batch semantics, errors."""

from __future__ import annotations

import contextlib
import itertools
import json
import os

import pytest
import torch

from megaloop.config_utils import ConfigError
from megaloop.data import DataConfig, DataError, build_eval_loader, build_train_loader, make_batch
from megaloop.data.streaming import samples_per_rank
from megaloop.data.synthetic import decode_ids, write_synthetic_mds

SEQ = 32


@pytest.fixture(scope="module")
def synth(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("synth") / "ds"
    write_synthetic_mds(out, num_sequences=96, seq_len=SEQ, vocab_size=512, size_limit=1 << 12)
    return str(out)


def _ids(batches) -> list[int]:
    return [int(i) for b in batches for i in decode_ids(b["tokens"].numpy(), 512)]


def _loader(path: str, workers: int = 0, dp_rank: int = 0, dp_size: int = 1, mbs: int = 4,
            **kw) -> "object":
    cfg = DataConfig(path=path, num_workers=workers, **kw)
    return build_train_loader(cfg, seq_len=SEQ, micro_batch_size=mbs, dp_rank=dp_rank,
                              dp_size=dp_size, seed=7)


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_mid_epoch_yields_exactly_the_remaining_batches(synth, workers):
    a = _loader(synth, workers)
    assert a.batches_per_epoch == 24
    it = iter(a)
    first = list(itertools.islice(it, 7))
    sd = json.loads(json.dumps(a.state_dict()))  # must survive a JSON round trip
    assert sd["epoch"] == 0 and sd["sample_in_epoch"] == 28
    ref = list(itertools.islice(it, 30))  # crosses into epoch 1
    assert a.epoch == 1
    b = _loader(synth, workers)
    b.load_state_dict(sd)
    got = list(itertools.islice(iter(b), 30))
    assert _ids(got) == _ids(ref)
    for x, y in zip(got, ref):
        assert torch.equal(x["tokens"], y["tokens"]) and torch.equal(x["loss_mask"], y["loss_mask"])
    # epoch 0 is a permutation of the dataset; epoch 1 is shuffled differently
    epoch0 = _ids(first) + _ids(ref[:17])
    assert sorted(epoch0) == list(range(96))
    assert _ids(ref[17:24]) != epoch0[:28]
    a.close()
    b.close()


def test_resume_at_epoch_boundary_and_with_two_dp_ranks(synth):
    for rank in range(2):
        a = _loader(synth, dp_rank=rank, dp_size=2)
        it = iter(a)
        list(itertools.islice(it, a.batches_per_epoch))  # exactly one epoch
        sd = a.state_dict()
        ref = list(itertools.islice(it, 5))
        b = _loader(synth, dp_rank=rank, dp_size=2)
        b.load_state_dict(sd)
        assert _ids(itertools.islice(iter(b), 5)) == _ids(ref)


def test_dp_ranks_partition_the_epoch(synth):
    seen = []
    for rank in range(2):
        lo = _loader(synth, dp_rank=rank, dp_size=2)
        assert lo.batches_per_epoch == 12
        seen.append(_ids(itertools.islice(iter(lo), lo.batches_per_epoch)))
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == list(range(96))


def test_load_state_rejects_other_dataset(synth, tmp_path):
    other = tmp_path / "other"
    write_synthetic_mds(other, num_sequences=40, seq_len=SEQ, vocab_size=512)
    with pytest.raises(DataError, match=r"different dataset .*\(96 vs 40 samples\): resume on the data the run trained on, or start a new run from its weights \(train.init_weights=CHECKPOINT\)$"):
        _loader(str(other)).load_state_dict(_loader(synth).state_dict())


def test_batch_semantics(synth):
    batch = next(iter(_loader(synth, mask_document_boundaries=True)))
    t, y, m = batch["tokens"], batch["labels"], batch["loss_mask"]
    assert t.shape == y.shape == m.shape == (4, SEQ)
    assert t.dtype == y.dtype == torch.long and m.dtype == torch.float32
    assert torch.equal(y[:, :-1], t[:, 1:]) and (y[:, -1] == 0).all()
    assert (m[:, -1] == 0).all()
    assert torch.equal(m[:, :-1] == 0, t[:, :-1] == 0)  # masked exactly after-EOS targets
    plain = make_batch(t, eos_id=0, mask_document_boundaries=False)["loss_mask"]
    assert plain[:, :-1].min() == 1 and plain.sum() == 4 * (SEQ - 1)


def test_seq_len_mismatch_names_manifest(synth):
    with pytest.raises(ConfigError, match=rf"{synth}/manifest.json holds sequences of {SEQ}"):
        build_train_loader(DataConfig(path=synth), seq_len=SEQ * 2, micro_batch_size=2,
                           dp_rank=0, dp_size=1, seed=0)
    with pytest.raises(ConfigError, match="manifest.json"):
        build_eval_loader(synth, seq_len=16, micro_batch_size=2, dp_rank=0, dp_size=1)


def test_shard_seq_len_mismatch_names_shard(synth, tmp_path):
    import shutil

    copy = tmp_path / "lying"
    shutil.copytree(synth, copy)
    man = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps(man | {"seq_len": 16}))
    with pytest.raises(ConfigError, match=r"shard .*shard\.00000\.mds\.zstd stores tokens as"):
        build_train_loader(DataConfig(path=str(copy)), seq_len=16, micro_batch_size=2,
                           dp_rank=0, dp_size=1, seed=0)


def test_missing_or_corrupt_dataset_errors(tmp_path, synth):
    with pytest.raises(DataError, match="does not exist"):
        _loader(str(tmp_path / "nowhere"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "manifest.json").write_text("{oops")
    with pytest.raises(DataError, match=r"bad/manifest.json is corrupt"):
        _loader(str(tmp_path / "bad"))
    shard = tmp_path / "shard.jsonl"
    shard.write_text('{"text": "x"}\n')
    with pytest.raises(DataError, match=f"{shard} is a file, not a dataset directory"):
        _loader(str(shard))
    raw = tmp_path / "raw"  # a TxT360 tree passed where its converted shards belong
    (raw / "data" / "wiki" / "1-1").mkdir(parents=True)
    (raw / "data" / "wiki" / "1-1" / "a.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(DataError, match="raw TxT360-layout tree.*convert it first with data_prep/txt360_to_mds.py"):
        _loader(str(raw))
    with pytest.raises(ConfigError, match="dp_rank"):
        _loader(synth, dp_rank=2, dp_size=2)


def test_eval_loader_covers_each_sample_once_across_ranks(synth):
    seen, nb = [], set()
    for rank in range(3):
        ev = build_eval_loader(synth, seq_len=SEQ, micro_batch_size=5, dp_rank=rank, dp_size=3)
        batches = list(ev)
        nb.add(len(batches))
        assert len(batches) == len(ev)
        for b in batches:
            assert b["tokens"].shape == (5, SEQ)
            real = b["loss_mask"][:, 0] > 0
            seen += [int(i) for i in decode_ids(b["tokens"][real].numpy(), 512)]
    assert len(nb) == 1  # same number of batches on every rank
    assert sorted(seen) == list(range(96))


@pytest.mark.parametrize("n,ncn,dp", [(96, 1, 1), (101, 2, 2), (97, 4, 2), (97, 2, 4),
                                      (1000, 8, 8), (33, 3, 3), (50, 1, 4)])
def test_samples_per_rank_matches_streaming(n, ncn, dp):
    from streaming.base.partition import get_partitions

    ids = get_partitions("relaxed", n, ncn, dp, 1, 1, 1, 0, None)
    counts = (ids.reshape(dp, -1) >= 0).sum(axis=1)
    assert set(counts.tolist()) == {samples_per_rank(n, ncn, dp)}


def test_ignores_a_stale_registration_of_its_cache_slot(synth):
    """A process killed without clean-up can leave streaming's shared-memory registration of its
    cache slot behind; the next loader that takes the slot must not fail on it."""
    import gc
    import os
    import tempfile

    from streaming.base.shared import SharedMemory
    from streaming.base.shared.prefix import _pack_locals

    probe = _loader(synth)
    slot = probe._ds.streams[0].local
    probe.close()
    del probe
    gc.collect()
    prefix = next(p for p in range(10_000) if not any(
        os.path.exists(f) for f in (f"/dev/shm/{p:06}_locals",
                                    os.path.join(tempfile.gettempdir(), f"{p:06}_barrier_filelock"),
                                    os.path.join(tempfile.gettempdir(), f"{p:06}_cache_filelock"))))
    data = _pack_locals([os.path.abspath(slot)], prefix)
    stale = SharedMemory(f"{prefix:06}_locals", True, len(data))  # unlinked at exit
    stale.buf[:len(data)] = data
    lo = _loader(synth)  # takes the same slot; without the scrub: "Reused local directory"
    assert lo._ds.streams[0].local == slot
    assert len(_ids(itertools.islice(iter(lo), 3))) == 12
    lo.close()


def test_resume_at_another_dp_size_keeps_the_global_order(synth):
    """Elastic resume: 2 ranks x 2 batches consumed, continue on 4 ranks with the same order."""
    cfg = dict(num_canonical_nodes=4)
    two = [_loader(synth, dp_rank=r, dp_size=2, **cfg) for r in range(2)]
    seen = [_ids(itertools.islice(iter(lo), 2)) for lo in two]
    sd = two[0].state_dict()
    assert sd["sample_in_epoch"] == 16
    four = [_loader(synth, dp_rank=r, dp_size=4, **cfg) for r in range(4)]
    for lo in four:
        lo.load_state_dict(sd)
    rest = [_ids(itertools.islice(iter(lo), 5)) for lo in four]  # (96 - 16) / 4 ranks / 4
    everything = [i for part in seen + rest for i in part]
    assert sorted(everything) == list(range(96))  # nothing repeated, nothing skipped


def test_resume_at_a_dp_size_that_does_not_divide_the_position_is_refused(synth):
    """9 samples consumed at DP=1 (an odd global batch), resumed at DP=2: streaming rounded the offset
    down to 8 with a warning of its own, sample 8 was trained twice and every later one shifted."""
    one = _loader(synth, dp_size=1, mbs=3, num_canonical_nodes=1)
    list(itertools.islice(iter(one), 3))
    sd = one.state_dict()
    assert sd["sample_in_epoch"] == 9
    two = _loader(synth, dp_rank=0, dp_size=2, mbs=3, num_canonical_nodes=1)
    with pytest.raises(DataError, match=r"position in epoch 0 is sample 9, which data-parallel size 2 does not "
                                        r"divide .*train 1 sample\(s\) twice\); resume at a data-parallel size "
                                        r"that divides it and fits its 1 canonical nodes \(1, 3, 9\), or keep"):
        two.load_state_dict(sd)
    three = _loader(synth, dp_rank=0, dp_size=3, mbs=3, num_canonical_nodes=1)
    three.load_state_dict(sd)  # 3 divides 9: accepted, as offered
    # sizes the canonical nodes do not fit are not offered (they are refused on their own)
    at2 = _loader(synth, dp_size=1, mbs=3, num_canonical_nodes=2)
    list(itertools.islice(iter(at2), 3))
    with pytest.raises(DataError, match=r"fits its 2 canonical nodes \(1\), or keep"):
        _loader(synth, dp_rank=0, dp_size=2, mbs=3, num_canonical_nodes=2).load_state_dict(at2.state_dict())


def test_a_position_past_the_last_full_step_of_the_new_size_is_not_refused(synth):
    """At the exact end of an epoch (95 of 96 samples at micro batch 5) DP=2 has nothing left in it:
    no sample repeats, so the refusal (which advised keeping the size to the epoch's end) does not fire."""
    one = _loader(synth, mbs=5, num_canonical_nodes=1)
    list(itertools.islice(iter(one), 19))
    sd = one.state_dict()
    assert (sd["epoch"], sd["sample_in_epoch"]) == (0, 95)
    two = _loader(synth, dp_rank=0, dp_size=2, mbs=5, num_canonical_nodes=1)
    two.load_state_dict(sd)
    next(iter(two))
    assert two.epoch == 1


def test_resume_under_another_explicit_partition_is_refused(synth):
    """The loader kept the checkpoint's num_canonical_nodes while config.yaml recorded the new value,
    so a re-run of that file trained another order; null resumes with the checkpoint's."""
    two = _loader(synth, num_canonical_nodes=2)
    list(itertools.islice(iter(two), 2))
    sd = two.state_dict()
    with pytest.raises(DataError, match=r"sample order uses 2 canonical nodes \(this run: data.num_canonical_nodes=4\)"
                                        r"; resume with data.num_canonical_nodes=2 \(or null"):
        _loader(synth, num_canonical_nodes=4).load_state_dict(sd)
    derived = _loader(synth)  # null: the checkpoint's
    derived.load_state_dict(sd)
    assert derived.num_canonical_nodes == 2


def test_loaders_give_back_descriptors_and_shared_memory(synth):
    """Building, using and dropping loaders (closed or not, train or eval) returns every file
    descriptor and shared-memory segment; a new loader's cost does not grow with the number of
    live ones (streaming's prefix search used to keep each probed segment open until exit, which
    ran a long process into a 1,024-descriptor limit)."""
    import gc
    import os

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    def segments() -> set[str]:
        return set(os.listdir("/dev/shm"))

    def others() -> set[str]:
        """Segments another live process maps (a parallel test worker's loaders), not ours to count."""
        held = set()
        for pid in filter(str.isdigit, os.listdir("/proc")):
            if int(pid) == os.getpid():
                continue
            try:
                with open(f"/proc/{pid}/maps") as f:
                    held.update(line.rsplit("/dev/shm/", 1)[1].split()[0] for line in f if "/dev/shm/" in line)
            except OSError:  # gone, or not ours to read
                continue
        return held

    def cycle() -> None:
        a = _loader(synth)
        next(iter(a))
        a.close()
        b = _loader(synth)
        it = iter(b)
        next(it), next(it)
        del b, it  # dropped without close(): the download threads must not keep it alive
        ev = build_eval_loader(synth, seq_len=SEQ, micro_batch_size=4, dp_rank=0, dp_size=1)
        next(iter(ev))
        del ev
        gc.collect()

    cycle()  # first-use imports and caches
    n0, s0 = fds(), segments()
    for _ in range(3):
        cycle()
    assert fds() == n0
    assert segments() - s0 - others() == set()

    live = [_loader(synth) for _ in range(6)]
    costs = []
    for _ in range(3):
        before = fds()
        live.append(_loader(synth))
        costs.append(fds() - before)
    assert max(costs) - min(costs) <= 1, costs  # not one more per live loader's segments
    for lo in live:
        lo.close()


def test_a_closed_loaders_exit_cleanup_leaves_a_later_loaders_segments(synth, monkeypatch):
    """``close()`` unlinks the segments a loader created; streaming's own clean-up of them, registered
    with ``atexit``, must then do nothing. It used to unlink them again by name at exit: by then
    a later loader (in this process or another megaloop process on the machine) held segments of
    the same names, which were unlinked under it (its other ranks or workers could no longer attach)
    and the resource tracker printed a KeyError traceback per segment. Here the later holder takes
    the closed loader's very names (whatever prefix another process's loader would get)."""
    import atexit
    from multiprocessing import shared_memory

    exits: list = []
    real = atexit.register

    def record(fn, *a, **k):
        exits.append((fn, a, k))
        return real(fn, *a, **k)

    monkeypatch.setattr(atexit, "register", record)
    a = _loader(synth)
    next(iter(a))
    monkeypatch.setattr(atexit, "register", real)
    prefix = f"{a._ds._shm_prefix_int:06}_"
    names = {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}
    assert len(names) >= 4, names
    a.close()
    assert not names & set(os.listdir("/dev/shm"))
    later = [shared_memory.SharedMemory(n, create=True, size=64) for n in sorted(names)]
    try:
        for fn, args, kwargs in exits:  # what would run at exit for the closed loader
            fn(*args, **kwargs)
        assert names <= set(os.listdir("/dev/shm")), names - set(os.listdir("/dev/shm"))
    finally:
        for seg in later:
            seg.close()
            with contextlib.suppress(FileNotFoundError):
                seg.unlink()


def test_resume_under_another_sample_order_is_refused(synth):
    """data.shuffle / shuffle_algo / shuffle_block_size changed on resume used to be accepted: the saved
    position then counted samples in another order, so some were seen twice and others never. Now
    refused naming the fields; the block size and algorithm do not matter without shuffling."""
    from megaloop.data.errors import DataError

    a = _loader(synth)
    list(itertools.islice(iter(a), 3))
    sd = a.state_dict()
    a.close()
    assert sd["order"] == {"shuffle": True, "shuffle_algo": "py1e", "shuffle_block_size": None}
    for kw, says in ((dict(shuffle=False), "data.shuffle=true (this run: false)"),
                     (dict(shuffle_algo="naive"), "data.shuffle_algo=py1e (this run: naive)"),
                     (dict(shuffle_block_size=100), "data.shuffle_block_size=null (this run: 100)")):
        b = _loader(synth, **kw)
        with pytest.raises(DataError, match="data loader state was saved with ") as err:
            b.load_state_dict(sd)
        assert says in str(err.value) and str(err.value).count("this run:") == 1 and "resume with data.shuffle=true data.shuffle_algo=py1e " \
            "data.shuffle_block_size=null" in str(err.value), str(err.value)
        b.close()
    plain = _loader(synth, shuffle=False)
    list(itertools.islice(iter(plain), 2))
    sd = plain.state_dict()
    plain.close()
    other = _loader(synth, shuffle=False, shuffle_algo="naive", shuffle_block_size=7)  # meaningless unshuffled
    other.load_state_dict(sd)
    assert len(_ids(itertools.islice(iter(other), 2))) == 8
    other.close()
    legacy = _loader(synth, shuffle=False)  # a state saved before the order was kept: not checked
    legacy.load_state_dict({k: v for k, v in sd.items() if k != "order"})
    legacy.close()


def test_sample_order_of_a_saved_config():
    """A checkpoint saved before the loader state kept its order: the trainer checks the saved
    config's data section instead (megaloop.data.loaders.sample_order; missing keys: the defaults)."""
    from megaloop.data.loaders import sample_order

    assert sample_order({}) == {"shuffle": True, "shuffle_algo": "py1e", "shuffle_block_size": None}
    assert sample_order({"shuffle": False, "shuffle_algo": "naive"}) == {"shuffle": False}
    assert sample_order({"shuffle_block_size": 9}) == {"shuffle": True, "shuffle_algo": "py1e",
                                                       "shuffle_block_size": 9}
