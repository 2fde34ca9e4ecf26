"""data.val_path checked against the training data (megaloop/train/val_set.py): the training set
itself is refused; a set built as training data, or held out with other bands than the training
shards, is warned about (it used to validate on training data without a word)."""

from __future__ import annotations

import pytest

from megaloop.config_utils import ConfigError
from megaloop.train.val_set import check_val_manifest

TOK = {"tokenizer_sha256": "a" * 64}
SPEC = {"salt": "megaloop-holdout-v1", "screen_fraction": 0.001, "val_fraction": 0.002}


def _check(tmp_path, val: dict, train: dict | None = None, val_name: str = "val", **kw):
    (tmp_path / "train").mkdir(exist_ok=True)
    (tmp_path / val_name).mkdir(exist_ok=True)
    train = {"kind": "train", "holdout": SPEC, "seq_len": 32, **TOK} if train is None else train
    args = dict(seq_len=32, micro_batch_size=4, fp8=False) | kw
    return check_val_manifest(str(tmp_path / val_name), val, str(tmp_path / "train"), train, **args)


def test_a_held_out_set_of_the_same_bands_passes_silently(tmp_path):
    assert _check(tmp_path, {"kind": "val", "holdout": SPEC, "seq_len": 16, **TOK}) == (16, [])
    assert _check(tmp_path, {"seq_len": 32}) == (32, [])  # a set without provenance: nothing to compare


def test_the_training_set_itself_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"^data.val_path: .*/train is data.path, the training set"):
        _check(tmp_path, {"kind": "train", "holdout": SPEC, **TOK}, val_name="train/../train")


def test_a_training_kind_set_or_other_bands_are_warned_about(tmp_path):
    _, warn = _check(tmp_path, {"kind": "train", "holdout": SPEC, **TOK}, val_name="other")
    assert len(warn) == 1 and "was built as training data (manifest kind: train)" in warn[0]
    other = dict(SPEC, val_fraction=0.15, screen_fraction=0.15)
    _, warn = _check(tmp_path, {"kind": "val", "holdout": other, **TOK})
    assert len(warn) == 1 and "was held out with" in warn[0] and "'val_fraction': 0.15" in warn[0] \
        and "'val_fraction': 0.002" in warn[0], warn


def test_the_earlier_refusals_still_hold(tmp_path):
    with pytest.raises(ConfigError, match="was tokenised with tokenizer sha256 bbbbbbbbbbbb…"):
        _check(tmp_path, {"kind": "val", "tokenizer_sha256": "b" * 64})
    with pytest.raises(ConfigError, match="holds 64-token sequences, longer than model.seq_len=32"):
        _check(tmp_path, {"kind": "val", "seq_len": 64, **TOK})
    with pytest.raises(ConfigError, match="with model.fp8, seq x micro_batch_size 3 must be a multiple of 16"):
        _check(tmp_path, {"kind": "val", "seq_len": 30, **TOK}, micro_batch_size=3, fp8=True)


def test_validation_masks_document_boundaries_as_training_does(megatron_world, tmp_path, monkeypatch):
    """data.mask_document_boundaries zeroed the loss after each EOS in training only: validation
    scored those targets, so val_ce and the training loss were measured on different targets."""
    import megaloop.data as data
    from megaloop.config import load_config
    from megaloop.train.trainer import Trainer

    seen, val = [], {}
    real = data.build_eval_loader

    def spy(*a, **k):
        seen.append(k.get("mask_document_boundaries", False))
        return real(*a, **k)

    monkeypatch.setattr(data, "build_eval_loader", spy)
    for masked in (False, True):
        t = Trainer(load_config("tiny", ["train.max_steps=3", "train.global_batch_size=4",
                                         "train.micro_batch_size=2", "optim.warmup_steps=1", "logging.progress=false",
                                         "train.eval_interval=0", "train.save_interval=0", "train.eval_batches=2",
                                         f"data.mask_document_boundaries={str(masked).lower()}"]),
                    tmp_path / f"run{masked}")
        t.setup()
        try:
            val[masked] = t.evaluate()["val_ce"]
        finally:
            t.loader.close()
            t.close()
    assert seen == [False, False, True, True]  # each read once at set-up (its batches checked), then evaluated
    assert val[True] != val[False]  # the same weights (init seed) and sequences: only the targets differ


def test_the_embedded_validation_split_beside_another_tokenizers_data_is_refused(megatron_world, tmp_path,
                                                                                 monkeypatch):
    """data.path=OWN data.val_path=default:val (what slurm/train_*.sh passed for EXTRA_ARGS="data.path=...")
    skipped the tokenizer check: validation scored the embedded corpus's ids under another vocabulary
    (an IndexError at the first evaluation for a smaller one, silently wrong CE for a larger one)."""
    import json

    from megaloop.config import load_config
    from megaloop.data.synthetic import write_synthetic_mds
    from megaloop.train.trainer import Trainer

    own = tmp_path / "default_own"  # a folder whose name starts with "default" is not the embedded corpus
    write_synthetic_mds(own, num_sequences=64, seq_len=128, vocab_size=400, size_limit=1 << 14)
    manifest = json.loads((own / "manifest.json").read_text())
    (own / "manifest.json").write_text(json.dumps({**manifest, "tokenizer_sha256": "b" * 64}))
    monkeypatch.chdir(tmp_path)
    t = Trainer(load_config("tiny", ["train.max_steps=4", "optim.warmup_steps=1", "logging.progress=false",
                                     "data.path=default_own", "data.val_path=default:val", "train.save_interval=0"]),
                tmp_path / "run")
    try:
        with pytest.raises(ConfigError, match=r"data.val_path: default:val was tokenised with tokenizer sha256 "
                                              r"\w{12}…, the training data \(default_own\) with bbbbbbbbbbbb…"):
            t.setup()
    finally:
        t.close()


def test_a_set_ending_documents_with_another_eos_is_refused(tmp_path):
    """Same tokenizer, another --eos-token (<|pad|>, id 2, where the training data ends documents with
    0): it validated silently."""
    train = {"kind": "train", "holdout": SPEC, "seq_len": 32, **TOK, "tokenizer": {"eos_id": 0}}
    with pytest.raises(ConfigError, match=r"ends its documents with EOS id 2, the training data .* with 0"):
        _check(tmp_path, {"kind": "val", "holdout": SPEC, "eos_id": 2, **TOK}, train)
    assert _check(tmp_path, {"kind": "val", "holdout": SPEC, "eos_id": 0, **TOK}, train) == (32, [])
