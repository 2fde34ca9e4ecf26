"""data_prep/build_eval_sets.py: held-out validation and LR-screen sets."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megaloop.data import DataError, build_eval_loader, load_tokenizer
from megaloop.data.eval_sets import EvalSetsConfig, build_eval_sets
from megaloop.data.mds_convert import ConvertConfig, convert_txt360
from megaloop.data.txt360 import HoldoutSpec

HOLD = HoldoutSpec(val_fraction=0.1, screen_fraction=0.1)


def _rows(path, seq_len):
    loader = build_eval_loader(path, seq_len=seq_len, micro_batch_size=8, dp_rank=0, dp_size=1,
                               with_source=True)
    toks, srcs = [], []
    for b in loader:
        keep = b["loss_mask"][:, 0] > 0
        toks.append(b["tokens"][keep].numpy())
        srcs += [s for s, k in zip(b["source"], keep.tolist()) if k]
    return np.concatenate(toks), srcs


def test_eval_sets_are_held_out_and_sized(tmp_path, txt360_tree, fixture_tokenizer):
    tree, texts = txt360_tree
    train = convert_txt360(ConvertConfig(input=tree, out=tmp_path / "train",
                                         tokenizer=str(fixture_tokenizer), seq_len=16,
                                         holdout=HOLD, progress=False))
    cfg = EvalSetsConfig(input=tree, out=tmp_path / "eval", tokenizer=str(fixture_tokenizer),
                         holdout=HOLD, val_seq_len=24, val_sequences_per_source=20,
                         screen_seq_len=32, screen_sequences=12, workers=2, progress=False,
                         train_manifest=tmp_path / "train" / "manifest.json")
    res = build_eval_sets(cfg)
    val, screen = res["val"], res["screen"]
    assert screen["num_sequences"] == 12 and screen["seq_len"] == 32
    assert screen["total_tokens"] == 12 * 32
    assert set(val["sources"]) == {"alpha", "beta"}
    assert all(0 < v["num_sequences"] <= 20 for v in val["sources"].values())
    assert "provenance" in val and val["holdout"] == HOLD.to_dict()
    rows, srcs = _rows(tmp_path / "eval" / "val", 24)
    assert rows.shape == (val["num_sequences"], 24)
    assert {s: srcs.count(s) for s in set(srcs)} == {
        s: v["num_sequences"] for s, v in val["sources"].items()}
    srows, _ = _rows(tmp_path / "eval" / "screen", 32)
    assert srows.shape == (12, 32)
    # Band counts agree with the training manifest: every doc is in exactly one place.
    bands = {"val": 0, "screen": 0, "train": 0}
    for docs in texts.values():
        for d in docs:
            bands[HOLD.band(d)] += 1
    assert sum(v["docs_val"] for v in train["sources"].values()) == bands["val"]
    assert sum(v["docs_screen"] for v in train["sources"].values()) == bands["screen"]
    assert sum(v["docs"] for v in train["sources"].values()) == bands["train"]
    # The text of the validation set is made of validation-band documents only.
    tok = load_tokenizer(fixture_tokenizer)
    val_text = tok.decode(rows.reshape(-1).tolist())
    first_doc = val_text.split("<|endoftext|>")[1]
    assert first_doc and any(first_doc in d and HOLD.band(d) == "val"
                             for docs in texts.values() for d in docs)
    # Rerun: both sets are up to date and reused.
    again = build_eval_sets(cfg)
    assert again["val"]["fingerprint"] == val["fingerprint"]
    assert not list((tmp_path / "eval").glob(".tmp-*"))


def test_screen_set_too_small_and_holdout_mismatch(tmp_path, txt360_tree, fixture_tokenizer):
    tree, _ = txt360_tree
    cfg = EvalSetsConfig(input=tree, out=tmp_path / "e", tokenizer=str(fixture_tokenizer),
                         holdout=HOLD, val_seq_len=24, screen_seq_len=1536, screen_sequences=304,
                         progress=False)
    with pytest.raises(DataError, match=r"LR-screen set needs 304 x 1536 .*--screen-fraction"):
        build_eval_sets(cfg)
    assert not (tmp_path / "e" / "screen").exists()
    manifest = tmp_path / "m.json"
    manifest.write_text(json.dumps({"holdout": HoldoutSpec().to_dict()}))
    cfg.train_manifest = manifest
    with pytest.raises(DataError, match="would overlap training"):
        build_eval_sets(cfg)


def test_eval_sets_count_used_documents_warn_on_left_out_sources_and_match_the_training_ids(
        tmp_path, txt360_tree, fixture_tokenizer, capsys):
    import dataclasses

    tree, texts = txt360_tree
    train = convert_txt360(ConvertConfig(input=tree, out=tmp_path / "train", tokenizer=str(fixture_tokenizer),
                                         seq_len=16, holdout=HOLD, progress=False))
    base = EvalSetsConfig(input=tree, out=tmp_path / "eval", tokenizer=str(fixture_tokenizer), holdout=HOLD,
                          val_seq_len=24, val_sequences_per_source=1, screen_seq_len=32, screen_sequences=2,
                          progress=False, train_manifest=tmp_path / "train" / "manifest.json")
    val = build_eval_sets(base)["val"]
    tok = load_tokenizer(fixture_tokenizer)
    for source, stats in val["sources"].items():  # one 24-token row: the documents it holds, not all encoded
        held = [d for d in texts_of(texts, source) if HOLD.band(d) == "val"]
        lens = np.cumsum([len(tok.encode(d)) + 1 for d in held])
        assert stats["docs_used"] == int(np.searchsorted(lens, 24)) + 1 < stats["docs_available"], (source, stats)
    # a tokenizer or EOS other than the training data's: refused before anything is built (train refused later)
    other = tmp_path / "other_tok"
    other.mkdir()
    (other / "tokenizer.json").write_text(fixture_tokenizer.read_text().replace('"<|pad|>"', '"<|pad2|>"'))
    with pytest.raises(DataError, match=r"--tokenizer .* is not the tokenizer of the training data"):
        build_eval_sets(dataclasses.replace(base, out=tmp_path / "e2", tokenizer=str(other)))
    with pytest.raises(DataError, match=r"--eos-token: EOS id 2, the training data's is 0"):
        build_eval_sets(dataclasses.replace(base, out=tmp_path / "e3", eos_token="<|pad|>"))
    assert not (tmp_path / "e2").exists() and not (tmp_path / "e3").exists()
    assert train["vocab_size"] == tok.vocab_size
    # a source whose held-out text cannot fill one sequence: left out with a warning (it was silent)
    capsys.readouterr()
    build_eval_sets(dataclasses.replace(base, out=tmp_path / "e4", val_seq_len=2000, train_manifest=None,
                                        screen_seq_len=16))
    err = capsys.readouterr().err
    assert "warning: no validation sequence of 2000 tokens from source(s)" in err


def texts_of(texts: dict, source: str) -> list[str]:
    return [d for (src, _), docs in sorted(texts.items()) if src == source for d in docs]
