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
