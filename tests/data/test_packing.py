"""``--packing whole``: on shards written by the converter, no document crosses a row, every document
arrives exactly as often as its mixture weight says, and the loaders mask the padding from the loss."""

from __future__ import annotations

import json
import random
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from megaloop.data import DataError, build_eval_loader, build_train_loader
from megaloop.data.config import DataConfig
from megaloop.data.mds_convert import ConvertConfig, convert_txt360, pack_whole
from megaloop.data.streaming import make_batch
from megaloop.data.synth import SOURCE, SynthConfig, TreeSpec, write_char_tokenizer, write_synth_tree
from megaloop.data.tokenizer import Tokenizer
from megaloop.data.txt360 import HoldoutSpec, MixSpec

ROOT = Path(__file__).resolve().parents[2]
SEQ = 48
NO_HOLDOUT = HoldoutSpec(val_fraction=0.0, screen_fraction=0.0)


def _tree(root: Path) -> Path:
    """Synthetic programs (k <= 4, <= 35 characters) plus a 'prose' source of 1..SEQ-1 characters."""
    write_synth_tree(root, TreeSpec(num_docs=300, num_files=2, eval_ks=(1,), eval_per_k=2,
                                    synth=SynthConfig(k_max=4)))
    rng = random.Random(0)
    prose = ["".join(rng.choice("abc de") for _ in range(rng.randint(1, SEQ - 1))) for _ in range(120)]
    path = root / "data" / "prose" / "2-5" / "0_1.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text("".join(json.dumps({"text": t, "meta": {}}) + "\n" for t in prose))
    return root


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    return _tree(tmp_path_factory.mktemp("synth_tree"))


def _convert(tree: Path, out: Path, packing: str = "whole", **kw) -> dict:
    cfg = ConvertConfig(input=tree, out=out, tokenizer=str(tree / "tokenizer"), seq_len=SEQ, workers=1,
                        holdout=NO_HOLDOUT, progress=False, packing=packing, **kw)
    return convert_txt360(cfg)


def _documents(tree: Path, tok: Tokenizer, mix: MixSpec) -> Counter:
    """Expected multiset of documents (token tuples with EOS) with their mixture copies (integer)."""
    from megaloop.data.txt360 import discover, read_jsonl

    want: Counter = Counter()
    for f in discover(tree):
        m = mix.multiplier(f.source, f.bucket)
        assert m == int(m)
        for _, text in read_jsonl(f.path):
            if not text.strip():  # the converter skips blank documents (counted as docs_empty)
                continue
            want[tuple(tok.encode(text) + [tok.eos_id])] += int(m)
    return want


def _rows(out: Path) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
    """Every row of a dataset in file order: tokens [n, SEQ], num_tokens [n], loader loss_mask [n, SEQ]."""
    loader = build_eval_loader(out, seq_len=SEQ, micro_batch_size=32, dp_rank=0, dp_size=1)
    try:
        masks = torch.cat([b["loss_mask"] for b in loader])[:loader.num_samples]
        samples = [loader._ds[i] for i in range(loader.num_samples)]
    finally:
        loader.close()
    toks = np.stack([np.asarray(s["tokens"], dtype=np.int64) for s in samples])
    counts = np.array([int(s.get("num_tokens", SEQ)) for s in samples])
    return toks, counts, masks


@pytest.mark.parametrize("weights", [None, {SOURCE: 2.0}])
def test_whole_rows_hold_complete_documents(tree, tmp_path, weights):
    mix = MixSpec(source_weights=weights or {})
    man = _convert(tree, tmp_path / "mds", mix=mix)
    tok = Tokenizer(tree / "tokenizer")
    pad = man["pad_fill_id"]
    assert man["packing"] == "whole" and man["columns"]["num_tokens"] == "int32" and pad == tok.pad_id == 2
    toks, counts, masks = _rows(tmp_path / "mds")
    assert len(toks) == man["num_sequences"]
    assert man["total_tokens"] == counts.sum() and man["pad_tokens"] == toks.size - counts.sum()
    assert man["dropped_tokens"] == 0
    got: Counter = Counter()
    for row, n in zip(toks, counts):
        assert 0 < n <= SEQ and row[n - 1] == tok.eos_id  # a row ends where a document ends
        assert (row[n:] == pad).all() and pad not in row[:n]
        ends = np.flatnonzero(row[:n] == tok.eos_id)
        for a, b in zip(np.r_[0, ends[:-1] + 1], ends + 1):
            got[tuple(row[a:b].tolist())] += 1
    # every document, whole, exactly (weight x bucket upsampling) times; nothing split or lost
    assert got == _documents(tree, tok, mix)
    # the loss mask: 1 exactly where input and target are both real tokens
    pos = torch.arange(SEQ)[None, :]
    assert torch.equal(masks, (pos < torch.from_numpy(counts)[:, None] - 1).float())


def test_concat_packing_does_cross_rows(tree, tmp_path):
    """The contrast that makes the test above meaningful: default rows cut documents."""
    man = _convert(tree, tmp_path / "concat", packing="concat")
    assert "num_tokens" not in man["columns"] and man["packing"] == "concat"
    toks, counts, masks = _rows(tmp_path / "concat")
    assert (counts == SEQ).all() and (masks[:, :-1] == 1).all()
    assert sum(row[-1] != man["eos_id"] for row in toks) > len(toks) // 2


def test_train_loader_masks_padding(tree, tmp_path):
    man = _convert(tree, tmp_path / "mds")
    loader = build_train_loader(DataConfig(path=str(tmp_path / "mds"), num_canonical_nodes=1), seq_len=SEQ,
                                micro_batch_size=8, dp_rank=0, dp_size=1, seed=0)
    try:
        it = iter(loader)
        batches = [next(it) for _ in range(5)]
    finally:
        loader.close()
    pad = man["pad_fill_id"]
    for b in batches:
        n = (b["tokens"] != pad).sum(1)  # padding only at the end of a row
        assert torch.equal(b["loss_mask"], (torch.arange(SEQ)[None] < n[:, None] - 1).float())
        assert (b["labels"][b["loss_mask"] > 0] != pad).all()
        assert (b["loss_mask"].sum(1) < SEQ - 1).any()  # some rows are padded


def test_overlong_document_is_an_error_naming_the_line(tmp_path):
    root = tmp_path / "t"
    write_char_tokenizer(root / "tokenizer")
    f = root / "data" / "src" / "1-1" / "0_1.jsonl"
    f.parent.mkdir(parents=True)
    f.write_text(json.dumps({"text": "short"}) + "\n" + json.dumps({"text": "y" * SEQ}) + "\n")
    with pytest.raises(DataError, match=rf"0_1.jsonl:2: document of {SEQ + 1} tokens .* --seq-len {SEQ}"):
        _convert(root, tmp_path / "out")
    assert not (tmp_path / "out" / "manifest.json").exists()
    man = _convert(root, tmp_path / "out2", packing="concat")  # concat cuts it instead
    assert man["num_sequences"] == 1
    with pytest.raises(DataError, match="--packing must be one of"):
        _convert(root, tmp_path / "out3", packing="bins")


def test_pack_whole_and_make_batch_units():
    docs = [np.array(d, dtype=np.uint32) for d in ([5, 0], [6, 6, 6, 0], [7, 0], [8, 8, 8, 8, 0])]
    rows, counts = pack_whole(docs, 6, pad_id=2)
    assert rows.tolist() == [[5, 0, 6, 6, 6, 0], [7, 0, 2, 2, 2, 2], [8, 8, 8, 8, 0, 2]]
    assert counts.tolist() == [6, 2, 5]
    b = make_batch(torch.from_numpy(rows.astype(np.int64)), 0, False, torch.from_numpy(counts))
    assert b["loss_mask"].tolist() == [[1, 1, 1, 1, 1, 0], [1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0]]
    assert b["labels"][0].tolist()[:5] == [0, 6, 6, 6, 0]


def test_converter_cli_flag(tree, tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "data_prep"))
    import txt360_to_mds

    out = tmp_path / "cli"
    assert txt360_to_mds.main(["--input", str(tree), "--out", str(out), "--tokenizer", str(tree / "tokenizer"),
                               "--seq-len", str(SEQ), "--packing", "whole", "--workers", "2", "--no-progress",
                               "--val-fraction", "0", "--screen-fraction", "0",
                               "--source-weights", f"{SOURCE}=2"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["packing"] == "whole" and summary["dropped_tokens"] == 0 and summary["pad_tokens"] > 0
    # two workers (fork pool) write the same rows as one
    ref = _convert(tree, tmp_path / "ref", mix=MixSpec(source_weights={SOURCE: 2.0}))
    assert json.loads((out / "manifest.json").read_text())["fingerprint"] == ref["fingerprint"]
    assert np.array_equal(_rows(out)[0], _rows(tmp_path / "ref")[0])
