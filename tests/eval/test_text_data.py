"""Text evaluation sets (raw text / JSONL / parquet) and the PPL protocol's lengths: packing with
EOS, MDS-layout labels, errors naming the file and option, re-cutting an MDS set per source, and
``evaluate_ppl`` with an explicit prefix length beyond the training length (RoPE extrapolation)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from megaloop.config_utils import ConfigError
from megaloop.data.errors import DataError
from megaloop.eval.ppl import PAPER_PREFIX_LEN, PAPER_SEQ_LEN, evaluate_ppl, load_eval_data, repack
from megaloop.eval.text_data import load_text_data, pack_documents, read_documents
from tests.inference.helpers import make_engine

DATA = Path(__file__).parent / "data" / "looped_models.txt"


def encode(text: str) -> list[int]:  # a stand-in tokenizer: bytes shifted past EOS
    return [b % 250 + 3 for b in text.encode()]


def test_shipped_text_file_packs_into_eos_separated_sequences():
    data = load_text_data(DATA, encode=encode, eos_id=0, seq_len=512)
    stream = encode(DATA.read_text()) + [0]
    n = len(stream) // 512
    assert data.tokens.shape == (n, 512) and n >= 5
    assert torch.equal(data.tokens.reshape(-1), torch.tensor(stream[:n * 512]))
    # labels / mask as the MDS loader makes them: next token, no target at the last position
    assert torch.equal(data.labels[:, :-1], data.tokens[:, 1:]) and data.loss_mask[:, -1].sum() == 0
    assert data.loss_mask[:, :-1].all() and data.source == str(DATA)
    assert load_text_data(DATA, encode=encode, eos_id=0, seq_len=512, max_seqs=2).num_seqs == 2


def test_jsonl_gz_and_parquet_give_the_same_documents(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = [p for p in DATA.read_text().split("\n\n") if p.strip()]
    with gzip.open(tmp_path / "docs.jsonl.gz", "wt") as fh:
        fh.write("\n".join(json.dumps({"body": d, "id": i}) for i, d in enumerate(docs)) + "\n\n")
    pq.write_table(pa.table({"body": docs}), tmp_path / "docs.parquet")
    assert read_documents(tmp_path / "docs.jsonl.gz", "body") == docs == read_documents(tmp_path / "docs.parquet",
                                                                                     "body")
    a = load_text_data(tmp_path / "docs.parquet", encode=encode, eos_id=0, seq_len=256, text_field="body")
    assert torch.equal(a.tokens, pack_documents([encode(d) for d in docs], 0, 256))
    assert (a.tokens == 0).sum() >= len(docs) - 2  # one EOS after every document


def test_bad_text_inputs_name_the_file_and_option(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("too short")
    with pytest.raises(DataError, match=rf"--data: {short} tokenises to 10 tokens \(1 documents\), fewer than "
                                        r"one sequence of --seq-len 64"):
        load_text_data(short, encode=encode, eos_id=0, seq_len=64)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"txt": "b"}\n')
    with pytest.raises(DataError, match=rf"--text-field: {bad}:2 has no string field 'text'"):
        read_documents(bad)
    bad.write_text('{"text": "a"}\nnot json\n')
    with pytest.raises(DataError, match=rf"--data: {bad}:2: invalid JSON"):
        read_documents(bad)
    bad.write_text('{"text": "a"}\n{"text": "lone \\ud800 x"}\n')  # the tokenizer raised a TypeError traceback
    with pytest.raises(DataError, match=rf"--data: {bad}:2: 'text' is not valid Unicode \(surrogates not allowed"):
        read_documents(bad)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["x"]}), tmp_path / "t.parquet")
    with pytest.raises(DataError, match=r"--text-field: .*t.parquet has no column 'text' \(columns: \['content'\]\)"):
        read_documents(tmp_path / "t.parquet")
    with pytest.raises(ConfigError, match="needs a tokenizer"):
        load_eval_data(str(DATA), default_seq_len=64)


def test_ppl_protocol_lengths_and_rope_extrapolation():
    assert (PAPER_SEQ_LEN, PAPER_PREFIX_LEN) == (8192, 4096)
    engine = make_engine(seed=1, depth=2, max_context=256)  # trained length 64 (max_position_embeddings)
    text = load_text_data(DATA, encode=_chars(engine),
                          eos_id=0, seq_len=192, max_seqs=2)
    res = evaluate_ppl(engine, text, prefix_len=48, protocols=("native", "terminal", "per_visit"))
    assert (res.seq_len, res.prefix_len, res.split, res.training_seq_len) == (192, 48, 48, 64)
    assert res.rope_extrapolated and res.tokens_scored == 2 * (192 - 48 - 1)
    assert res.per_visit_ppl == pytest.approx(res.native_ppl_second_half, rel=1e-5)
    half = evaluate_ppl(engine, text, protocols=("terminal",))
    assert half.prefix_len == 96 and half.terminal_ppl != res.terminal_ppl
    with pytest.raises(ConfigError, match=r"--prefix-len: must be in \[1, 190\] for 192-token sequences"):
        evaluate_ppl(engine, text, prefix_len=192)
    engine.max_context = 128
    with pytest.raises(ConfigError, match="longer than the model's context of 128"):
        evaluate_ppl(engine, text)


def _chars(engine):
    """The char tokenizer's encode, with characters outside its alphabet dropped."""
    from tests.inference.helpers import ALPHABET

    return lambda s: engine.encode("".join(c for c in s.lower() if c in ALPHABET))


def test_mds_set_is_recut_per_source():
    rows = torch.arange(6 * 4).reshape(6, 4)
    packed, src = repack(rows, ["a", "b", "a", "a", "b", "c"], 8)
    assert src == ["a", "b"] and packed.shape == (2, 8)  # a: 3 rows → 1 (tail dropped); c: too short
    assert packed[0].tolist() == rows[[0, 2]].reshape(-1).tolist()
    assert packed[1].tolist() == rows[[1, 4]].reshape(-1).tolist()
    whole, none = repack(rows, None, 12)
    assert none is None and whole.shape == (2, 12)


def test_mds_validation_set_at_a_longer_seq_len_keeps_sources():
    from megaloop.data.default_corpus import ensure_default_dataset

    val = str(ensure_default_dataset(seq_len=128) / "val")
    base = load_eval_data(val)
    assert base.seq_len == 128 and base.sources is not None and len(set(base.sources)) >= 2
    long = load_eval_data(val, seq_len=512)
    per = {s: base.sources.count(s) * 128 // 512 for s in dict.fromkeys(base.sources)}
    assert long.seq_len == 512 and long.num_seqs == sum(per.values())
    assert long.sources == [s for s, n in per.items() for _ in range(n)]
    first = [i for i, s in enumerate(base.sources) if s == base.sources[0]][:4]
    assert torch.equal(long.tokens[0], base.tokens[first].reshape(-1))
    assert torch.equal(long.labels[0, :-1], long.tokens[0, 1:])
    assert load_eval_data(val, seq_len=512, max_seqs=3).num_seqs == 3
    with pytest.raises(ConfigError, match=r"--seq-len: .* too few to re-cut"):
        load_eval_data(val, seq_len=1 << 20)
