"""data_prep/txt360_to_mds.py: counts, mixture proportions, resumability, errors, crash safety."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megaloop.data import DataError, build_eval_loader, build_train_loader, load_tokenizer
from megaloop.data.config import DataConfig
from megaloop.data.mds_convert import ConvertConfig, convert_txt360
from megaloop.data.txt360 import HoldoutSpec, MixSpec

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "data_prep" / "txt360_to_mds.py"
SEQ = 16
HOLDOUT = HoldoutSpec(val_fraction=0.05, screen_fraction=0.05)
MIX = MixSpec(source_weights={"alpha": 1.0, "beta": 2.0},
              bucket_upsample={"1-1": 1.0, "2-5": 2.0, "6-10": 3.0})


def _convert(tree: Path, tok: Path, out: Path, **kw) -> dict:
    kw = {"workers": 1, "mix": MIX, "holdout": HOLDOUT, "progress": False} | kw
    cfg = ConvertConfig(input=tree, out=out, tokenizer=str(tok), seq_len=SEQ, **kw)
    return convert_txt360(cfg)


def _read_all(path: Path) -> tuple[np.ndarray, list[str]]:
    """Every sample of an MDS dataset in order: tokens [n, SEQ], sources [n]."""
    loader = build_eval_loader(path, seq_len=SEQ, micro_batch_size=64, dp_rank=0, dp_size=1,
                               with_source=True)
    toks, srcs = [], []
    for b in loader:
        keep = b["loss_mask"][:, 0] > 0
        toks.append(b["tokens"][keep].numpy())
        srcs += [s for s, k in zip(b["source"], keep.tolist()) if k]
    return np.concatenate(toks), srcs


@pytest.fixture(scope="module")
def converted(tmp_path_factory, txt360_tree, fixture_tokenizer) -> tuple[Path, dict]:
    tree, _ = txt360_tree
    out = tmp_path_factory.mktemp("mds") / "train"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--input", str(tree), "--out", str(out), "--tokenizer",
         str(fixture_tokenizer), "--seq-len", str(SEQ), "--workers", "2", "--no-progress",
         "--source-weights", "alpha=1,beta=2", "--bucket-upsample", "1-1=1,2-5=2,6-10=3",
         "--val-fraction", "0.05", "--screen-fraction", "0.05"],
        capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, json.loads((out / "manifest.json").read_text())


def test_manifest_counts_match_direct_count(converted, txt360_tree, fixture_tokenizer):
    out, man = converted
    _, texts = txt360_tree
    tok = load_tokenizer(fixture_tokenizer)
    assert man["seq_len"] == SEQ and man["vocab_size"] == tok.vocab_size == 400
    assert man["eos_id"] == tok.eos_id and man["tokenizer_sha256"] == tok.sha256
    rows, srcs = _read_all(out)
    assert rows.shape == (man["num_sequences"], SEQ)
    assert man["total_tokens"] == rows.size == sum(man["source_tokens"].values())
    for src in ("alpha", "beta"):
        assert man["source_tokens"][src] == SEQ * srcs.count(src)
        direct = held = 0
        for (s, b), docs in texts.items():
            if s != src:
                continue
            for d in docs:
                if HOLDOUT.band(d) != "train":
                    held += 1
                    continue
                direct += (len(tok.encode(d)) + 1) * int(MIX.multiplier(s, b))
        info = man["sources"][src]
        assert info["doc_tokens"] == direct
        assert info["docs_val"] + info["docs_screen"] == held > 0
        assert info["packed_tokens"] + info["dropped_tokens"] == direct
    # every packed row is real text: EOS-separated and decodable
    assert (rows == tok.eos_id).sum() > 0


def test_mixture_proportions(converted, txt360_tree, fixture_tokenizer):
    out, man = converted
    _, texts = txt360_tree
    tok = load_tokenizer(fixture_tokenizer)
    raw = {k: sum(len(tok.encode(d)) + 1 for d in v if HOLDOUT.band(d) == "train")
           for k, v in texts.items()}
    want = {k: MIX.multiplier(*k) * n for k, n in raw.items()}
    total_want = sum(want.values())
    got = {(s, b): v["packed_tokens"] for s, info in man["sources"].items()
           for b, v in info["buckets"].items()}
    total_got = sum(got.values())
    for k in want:  # bucket upsampling x source weight, per (source, bucket)
        assert got[k] / total_got == pytest.approx(want[k] / total_want, rel=0.02), k
    _, srcs = _read_all(out)  # source shares as seen in the shards themselves
    for src in ("alpha", "beta"):
        share = sum(v for k, v in want.items() if k[0] == src) / total_want
        assert srcs.count(src) / len(srcs) == pytest.approx(share, rel=0.02)


def test_fractional_weight_downsamples(tmp_path, txt360_tree, fixture_tokenizer):
    tree, _ = txt360_tree
    man = convert_txt360(ConvertConfig(
        input=tree, out=tmp_path / "o", tokenizer=str(fixture_tokenizer), seq_len=SEQ,
        mix=MixSpec(source_weights={"beta": 0.5}, bucket_upsample={"2-5": 1.0, "6-10": 1.0}),
        holdout=HOLDOUT, progress=False, sources=["beta"]))
    docs = {b: v["docs"] for b, v in man["sources"]["beta"]["buckets"].items()}
    raw = man["sources"]["beta"]["raw_tokens"]
    assert man["sources"]["beta"]["doc_tokens"] == pytest.approx(0.5 * raw, rel=0.1)
    assert all(n > 0 for n in docs.values())


def _shard_hashes(out: Path) -> list:
    index = json.loads((out / "index.json").read_text())
    return [(s["raw_data"]["basename"], s["raw_data"]["hashes"]) for s in index["shards"]]


def test_rerun_skips_finished_work(tmp_path, txt360_tree, fixture_tokenizer, converted):
    tree, _ = txt360_tree
    src = tmp_path / "tree"
    shutil.copytree(tree, src)
    out = tmp_path / "out"
    first = _convert(src, fixture_tokenizer, out)
    assert first["_run"]["parts_skipped"] == 0
    # Deterministic: 1 in-process worker gives byte-identical shards to the 2-worker CLI run.
    assert _shard_hashes(out) == _shard_hashes(converted[0])
    stamp = {p: p.stat().st_mtime_ns for p in out.rglob("*.zstd")}
    again = _convert(src, fixture_tokenizer, out)
    assert again["_run"]["parts_skipped"] == again["_run"]["parts_total"] == 7
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*.zstd")} == stamp
    # Changing one input file redoes exactly that partition; results are deterministic.
    f = src / "data" / "beta" / "2-5" / "0_1.jsonl"
    f.write_text(f.read_text() + json.dumps({"text": "One more small document.", "meta": {}}) + "\n")
    # a manifest of the previous release lacks the bucket added since (1001-30000000): the same mix, not
    # "converted with other settings" (the update was refused without --overwrite)
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["mix"]["bucket_upsample"]["1001-30000000"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    third = _convert(src, fixture_tokenizer, out)
    assert third["_run"]["parts_skipped"] == 6
    fresh = _convert(src, fixture_tokenizer, tmp_path / "fresh")
    for key in ("total_tokens", "num_sequences", "sources", "fingerprint"):
        assert third[key] == fresh[key]


@pytest.mark.parametrize("killed_at", ["manifest", "index"])
def test_a_kill_while_publishing_is_resumed_by_the_same_command(tmp_path, txt360_tree, fixture_tokenizer,
                                                                converted, killed_at):
    """A kill between the atomic write's temp file and its rename left `.manifest.json.X.tmp` (or the
    index's) in --out, and every rerun was refused: "--out is not empty and holds no converted
    dataset". The rerun now finishes from the kept parts, to the uninterrupted result."""
    tree, _ = txt360_tree
    out = tmp_path / "out"
    _convert(tree, fixture_tokenizer, out)
    for name in ("manifest.json", "index.json") if killed_at == "index" else ("manifest.json",):
        (out / name).unlink()  # publishing unmarks the dataset first, then writes index, then manifest
    (out / f".{killed_at}.json.k3x9_2.tmp").write_text('{"half": ')
    again = _convert(tree, fixture_tokenizer, out)
    assert again["_run"]["parts_skipped"] == again["_run"]["parts_total"] == 7
    assert _shard_hashes(out) == _shard_hashes(converted[0])
    assert not list(out.glob(".*.tmp"))


def test_bad_input_errors_name_the_file(tmp_path, txt360_tree, fixture_tokenizer, capsys):
    tree, _ = txt360_tree
    with pytest.raises(DataError, match="does not exist"):
        _convert(tmp_path / "missing", fixture_tokenizer, tmp_path / "o1")
    (tmp_path / "empty" / "data" / "src").mkdir(parents=True)
    with pytest.raises(DataError, match=r"no \.jsonl"):
        _convert(tmp_path / "empty", fixture_tokenizer, tmp_path / "o2")
    with pytest.raises(DataError, match="nope.json"):
        _convert(tree, tmp_path / "nope.json", tmp_path / "o3")
    bad = tmp_path / "bad"
    shutil.copytree(tree, bad)
    f = bad / "data" / "beta" / "1-1" / "0_1.jsonl"
    f.write_text(f.read_text() + json.dumps({"meta": {"no": "text"}}) + "\n")
    with pytest.raises(DataError, match=rf"{f}:81: record has no 'text' field"):
        _convert(bad, fixture_tokenizer, tmp_path / "o4")
    # The CLI (run in-process here) reports the same error on stderr with exit status 2.
    cli = _cli_module()
    code = cli.main(["--input", str(bad), "--out", str(tmp_path / "o5"), "--tokenizer",
                     str(fixture_tokenizer), "--seq-len", "16", "--no-progress"])
    assert code == 2 and f"{f}:81" in capsys.readouterr().err


def _cli_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("txt360_to_mds_cli", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_failed_run_leaves_nothing_marked_complete(tmp_path, txt360_tree, fixture_tokenizer):
    tree, _ = txt360_tree
    bad = tmp_path / "tree"
    shutil.copytree(tree, bad)
    f = bad / "data" / "beta" / "6-10" / "0_1.jsonl"
    good = f.read_text()
    lines = good.splitlines()
    f.write_text("\n".join(lines[:20] + ["{not json"] + lines[20:]) + "\n")
    out = tmp_path / "out"
    with pytest.raises(DataError, match=f"{f}:21: invalid JSON"):
        _convert(bad, fixture_tokenizer, out, workers=2)
    assert not (out / "manifest.json").exists() and not (out / "index.json").exists()
    assert not (out / ".tmp").exists()
    with pytest.raises(DataError, match="manifest.json is missing"):
        build_train_loader(DataConfig(path=str(out)), seq_len=SEQ, micro_batch_size=2,
                           dp_rank=0, dp_size=1, seed=0)
    finished = {p.parent.name for p in out.glob("parts/*/_done.json")}
    f.write_text(good)
    man = _convert(bad, fixture_tokenizer, out, workers=2)
    assert man["_run"]["parts_skipped"] == len(finished)
    assert (out / "manifest.json").is_file()


def test_truncated_shard_error_names_shard(tmp_path, converted):
    out, man = converted
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    shard = sorted(copy.glob("parts/*/shard.*.mds.zstd"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=rf"{shard} is truncated"):
        build_train_loader(DataConfig(path=str(copy)), seq_len=SEQ, micro_batch_size=2,
                           dp_rank=0, dp_size=1, seed=0)
    os.unlink(shard)
    with pytest.raises(DataError, match=rf"{shard} listed in .*index.json is missing"):
        build_eval_loader(copy, seq_len=SEQ, micro_batch_size=2, dp_rank=0, dp_size=1)


def test_a_special_tokens_text_inside_a_document_stays_text(tmp_path, fixture_tokenizer):
    """A document that quotes ``<|endoftext|>`` (code, a crawled page about tokenizers) became an EOS
    id mid-document: a false document boundary (and a masked target under
    data.mask_document_boundaries). It is tokenised as text now: one EOS per document, at its end."""
    tok = load_tokenizer(str(fixture_tokenizer))
    eos = tok._tok.token_to_id("<|endoftext|>")
    assert eos == tok.eos_id
    docs = [f"doc {i}: the separator is <|endoftext|> and the river runs north of the city" for i in range(12)]
    tree = tmp_path / "tree"
    (tree / "data" / "web" / "1-1").mkdir(parents=True)
    (tree / "data" / "web" / "1-1" / "0_1.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    out = tmp_path / "out"
    _convert(tree, fixture_tokenizer, out, mix=MixSpec(), holdout=HoldoutSpec(val_fraction=0.0, screen_fraction=0.0))
    toks, _ = _read_all(out)
    assert (toks == eos).sum() <= len(docs)  # at most one per document (a packed row can cut the last)
    assert eos not in tok.encode_batch(docs)[0] and eos in tok.encode_batch(docs, specials_as_text=False)[0]


def test_document_ids_equal_the_tokenizers_own_encode_batch(fixture_tokenizer):
    """Documents are encoded with ``encode_batch_fast`` (no offsets: less time and memory); its ids must be
    ``encode_batch``'s, so datasets converted before keep their tokenisation on a rerun."""
    tok = load_tokenizer(str(fixture_tokenizer))
    docs = ["plain text, with  two spaces\n\nand lines", "ünïcödé 日本語 🙂 <|endoftext|> quoted", " ", "x" * 5000,
            "\t tabs\r\nand CRLF"]
    ref = tok._document_tokenizer().encode_batch(docs, add_special_tokens=False)
    assert tok.encode_batch(docs) == [e.ids for e in ref]
    assert tok.encode_batch(docs, specials_as_text=False) == [e.ids for e in tok._tok.encode_batch(docs, add_special_tokens=False)]
