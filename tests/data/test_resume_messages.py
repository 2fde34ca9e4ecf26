"""Resume refusals name what differs: the sample count, or (same count) the dataset fingerprint."""

from __future__ import annotations

import pytest

from megaloop.data import DataConfig, DataError, build_train_loader
from megaloop.data.synthetic import write_synthetic_mds

SEQ = 32


def _loader(path):
    return build_train_loader(DataConfig(path=str(path), num_workers=0), seq_len=SEQ, micro_batch_size=4,
                              dp_rank=0, dp_size=1, seed=7)


def test_same_count_other_fingerprint_names_the_fingerprint(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    write_synthetic_mds(a, num_sequences=40, seq_len=SEQ, vocab_size=512, seed=0)
    write_synthetic_mds(b, num_sequences=40, seq_len=SEQ, vocab_size=512, seed=1)
    la, lb = _loader(a), _loader(b)
    fa, fb = la.manifest["fingerprint"], lb.manifest["fingerprint"]
    assert fa != fb and la.num_samples == lb.num_samples
    with pytest.raises(DataError) as err:
        lb.load_state_dict(la.state_dict())
    msg = str(err.value)
    assert "fingerprint" in msg and fa[:12] in msg and fb[:12] in msg
    assert f"same number of samples ({la.num_samples})" in msg
    assert " vs " not in msg  # not the "(40 vs 40 samples)" of a count mismatch
    # a count mismatch still names the counts
    c = tmp_path / "c"
    write_synthetic_mds(c, num_sequences=48, seq_len=SEQ, vocab_size=512, seed=0)
    with pytest.raises(DataError, match=r"\(40 vs 48 samples\)"):
        _loader(c).load_state_dict(la.state_dict())


def _rebuild_with_new_fingerprint(src, dst):
    """``dst``: the same shards as ``src`` under another build fingerprint (what re-running the converter
    after a `touch` of an input, or a re-download, produces)."""
    import json
    import shutil

    shutil.copytree(src, dst)
    man = json.loads((dst / "manifest.json").read_text())
    man["fingerprint"] = "rebuilt-" + str(man["fingerprint"])
    (dst / "manifest.json").write_text(json.dumps(man))


def test_a_rebuild_with_the_same_content_resumes_and_says_so(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    write_synthetic_mds(a, num_sequences=40, seq_len=SEQ, vocab_size=512, seed=0)
    _rebuild_with_new_fingerprint(a, b)
    la = _loader(a)
    it = iter(la)
    next(it)
    state = la.state_dict()
    expected = next(it)
    assert state["dataset_content_sha256"]
    lb = _loader(b)
    assert lb.manifest["fingerprint"] != la.manifest["fingerprint"]
    lb.load_state_dict(state)
    got = next(iter(lb))
    assert lb.rebuilt and all((got[k] == expected[k]).all() for k in expected)
    # a state saved before the content hash was kept: the run's data.json supplies it (recorded_content)
    old = {k: v for k, v in state.items() if k != "dataset_content_sha256"}
    with pytest.raises(DataError, match="the shards' content could not be compared: resume on the data"):
        _loader(b).load_state_dict(old)
    lc = _loader(b)
    lc.load_state_dict(old, recorded_content=state["dataset_content_sha256"])
    assert lc.rebuilt
    # other content under another fingerprint is still refused, naming both
    write_synthetic_mds(c, num_sequences=40, seq_len=SEQ, vocab_size=512, seed=1)
    with pytest.raises(DataError, match="and other shard content: resume on the data the run trained on"):
        _loader(c).load_state_dict(state)


def test_recorded_content_reads_the_runs_data_json_for_its_build_only(tmp_path):
    import json

    from megaloop.train.run_files import recorded_content

    assert recorded_content(tmp_path, "fp") is None  # no data.json
    (tmp_path / "data.json").write_text(json.dumps({"manifest_fingerprint": "fp",
                                                    "content": {"sha256": "abc", "hashed": True}}))
    assert recorded_content(tmp_path, "fp") == "abc"
    assert recorded_content(tmp_path, "other") is None
    (tmp_path / "data.json").write_text(json.dumps({"manifest_fingerprint": "fp",
                                                    "content": {"sha256": "abc", "hashed": False}}))
    assert recorded_content(tmp_path, "fp") is None
    (tmp_path / "data.json").write_text("{not json")
    assert recorded_content(tmp_path, "fp") is None


def test_content_edited_under_the_same_fingerprint_is_refused(tmp_path):
    """The content hash was compared only when the manifest's build fingerprint differed: an index.json
    whose shards were reordered (manifest untouched) resumed silently into another sample order."""
    import json
    import shutil

    a, d = tmp_path / "a", tmp_path / "d"
    write_synthetic_mds(a, num_sequences=40, seq_len=SEQ, vocab_size=512, seed=0, size_limit=1 << 10)
    shutil.copytree(a, d)
    index = json.loads((d / "index.json").read_text())
    assert len(index["shards"]) > 1
    index["shards"].reverse()
    (d / "index.json").write_text(json.dumps(index))
    la = _loader(a)
    next(iter(la))
    state = la.state_dict()
    ld = _loader(d)
    assert ld.manifest["fingerprint"] == la.manifest["fingerprint"] and ld.num_samples == la.num_samples
    with pytest.raises(DataError, match=r"the same manifest fingerprint \(.*\) but other content \(shards and "
                                        r"index.json: saved sha256 .*, now .*\)"):
        ld.load_state_dict(state)
    _loader(tmp_path / "a").load_state_dict(state)  # the same data still resumes
    moved = tmp_path / "moved"
    shutil.copytree(a, moved)
    _loader(moved).load_state_dict(state)  # and so does a copy of it elsewhere
