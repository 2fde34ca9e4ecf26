"""Inputs nobody here prepared: odd TxT360 trees, an --out that already holds something, bad flags.

Each case must fail before work with one line naming the file, line or flag, or go through and say
on stderr what it skipped; nothing already written is lost or left marked complete.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from megaloop.data import DataError
from megaloop.data.eval_sets import EvalSetsConfig, build_eval_sets
from megaloop.data.mds_convert import ConvertConfig, convert_txt360
from megaloop.data.txt360 import MixSpec
from tests.data_prep.conftest import write_text_file

SEQ = 16
DOC = json.dumps({"text": "The river runs north of the old city and under the golden bridge."}) + "\n"


def _tree(root: Path, files: dict[str, str]) -> Path:
    """``files``: path under ``root/data`` -> content (``.gz`` names are gzipped)."""
    for rel, text in files.items():
        write_text_file(root / "data" / rel, text)
    return root


def _convert(tree: Path, tok: Path, out: Path, **kw):
    kw = {"workers": 1, "progress": False} | kw
    return convert_txt360(ConvertConfig(input=tree, out=out, tokenizer=str(tok), seq_len=SEQ, **kw))


def test_tree_shapes_that_would_be_misread(tmp_path, fixture_tokenizer, capsys):
    # x.jsonl beside x.jsonl.gz: one partition, so one file would be lost and the other counted twice
    both = _tree(tmp_path / "both", {"web/1-1/0_1.jsonl": DOC * 40, "web/1-1/0_1.jsonl.gz": DOC * 40})
    with pytest.raises(DataError, match=r"0_1\.jsonl and .*0_1\.jsonl\.gz would be the same partition"):
        _convert(both, fixture_tokenizer, tmp_path / "o1")
    assert not (tmp_path / "o1").exists()
    # x__y.jsonl beside x/y.jsonl: one parts/ folder (src__1-1__x__y); both were published, index.json
    # listed that folder's shard twice and the data of one file was lost
    flat = _tree(tmp_path / "flat", {"web/1-1/x__y.jsonl": DOC * 40, "web/1-1/x/y.jsonl": DOC * 40})
    with pytest.raises(DataError, match=r"x/y\.jsonl and .*x__y\.jsonl would be the same partition \('web/1-1/x/y' "
                                        r"and 'web/1-1/x__y' both flatten to the folder name 'web__1-1__x__y'"):
        _convert(flat, fixture_tokenizer, tmp_path / "o1")
    assert not (tmp_path / "o1").exists()
    # a source folder passed as --input: its buckets would become sources, the upsampling lost
    src = _tree(tmp_path / "src", {"web/1-1/0_1.jsonl": DOC * 40, "web/2-5/0_1.jsonl": DOC * 40})
    with pytest.raises(DataError, match=r"bucket folders \['1-1', '2-5'\], so it is one source's folder"):
        _convert(src / "data" / "web", fixture_tokenizer, tmp_path / "o2")
    with pytest.raises(DataError, match=r"0_1\.jsonl is a file; pass the TxT360 root"):
        _convert(src / "data" / "web" / "1-1" / "0_1.jsonl", fixture_tokenizer, tmp_path / "o2")
    # files that are not read and a misspelt bucket are named on stderr; the rest converts
    odd = _tree(tmp_path / "odd", {"web/1-1/0_1.jsonl": DOC * 40, "web/1-1/1_1.jsonl.zst": "x",
                                   "web/2-10/0_1.jsonl": DOC * 40, "wiki/1-1/0_1.parquet": "x",
                                   "stray.jsonl": DOC})
    capsys.readouterr()
    man = _convert(odd, fixture_tokenizer, tmp_path / "o3")
    err = capsys.readouterr().err
    assert "1 file(s) directly under" in err and "stray.jsonl" in err
    assert "web/1-1/1_1.jsonl.zst" in err and "source 'wiki' has no .jsonl" in err
    assert "folder(s) ['2-10'] look like duplicate buckets" in err
    assert set(man["sources"]) == {"web"} and set(man["sources"]["web"]["buckets"]) == {"1-1", "none"}


def test_unreadable_records_name_the_file_and_line(tmp_path, fixture_tokenizer):
    surrogate = _tree(tmp_path / "s", {"web/1-1/0_1.jsonl": DOC * 3 + '{"text": "lone \\ud800 here"}\n'})
    with pytest.raises(DataError, match=r"0_1\.jsonl:4: 'text' is not valid Unicode"):
        _convert(surrogate, fixture_tokenizer, tmp_path / "o1")
    for i, (value, kind) in enumerate((("null", "null"), ("5", "number"), ('["a"]', "array"))):
        typed = _tree(tmp_path / f"t{i}", {"web/1-1/0_1.jsonl": DOC * 2 + f'{{"text": {value}}}\n'})
        with pytest.raises(DataError) as err:  # JSON's type names, as for a record that is not an object
            _convert(typed, fixture_tokenizer, tmp_path / f"ot{i}")
        assert str(err.value).endswith(f"0_1.jsonl:3: 'text' is a JSON {kind}, expected a string")
    latin = _tree(tmp_path / "l", {"web/1-1/0_1.jsonl": DOC * 5})
    f = latin / "data" / "web" / "1-1" / "0_1.jsonl"
    f.write_bytes(f.read_bytes() + '{"text": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(DataError) as err:
        _convert(latin, fixture_tokenizer, tmp_path / "o2")
    assert str(err.value) == f"{f}:6: not UTF-8: byte 0xe9 at byte 14 of the line (invalid continuation byte)"
    # invalid JSON keeps json's position (it used to end "(Invalid control character at)")
    ctrl = _tree(tmp_path / "j", {"web/1-1/1_2.jsonl": DOC * 2 + '{"text": "a\tb"}\n' + DOC})
    with pytest.raises(DataError) as err:
        _convert(ctrl, fixture_tokenizer, tmp_path / "o4")
    assert str(err.value) == (f"{ctrl / 'data' / 'web' / '1-1' / '1_2.jsonl'}:3: invalid JSON "
                              "(Invalid control character at column 12)")
    bad = _tree(tmp_path / "k", {"web/1-1/0_1.jsonl": DOC + '{"text": "x" "y"}\n'})
    with pytest.raises(DataError, match=r"0_1\.jsonl:2: invalid JSON \(Expecting ',' delimiter at column 14\)$"):
        _convert(bad, fixture_tokenizer, tmp_path / "o5")
    corrupt = _tree(tmp_path / "c", {"web/1-1/0_1.jsonl.gz": DOC * 200})
    g = corrupt / "data" / "web" / "1-1" / "0_1.jsonl.gz"
    raw = bytearray(g.read_bytes())
    raw[40:80] = bytes(b ^ 0xFF for b in raw[40:80])  # damage the deflate stream, not the header
    g.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"0_1\.jsonl\.gz: cannot read"):
        _convert(corrupt, fixture_tokenizer, tmp_path / "o3")


def test_bad_flags_are_refused_before_work(tmp_path, txt360_tree, fixture_tokenizer):
    tree, _ = txt360_tree
    (tmp_path / "afile").write_text("x")
    for kw, msg in [({"seed": -1}, "--seed must be >= 0"), ({"shard_size_limit": 0}, "--shard-size must be >= 1"),
                    ({"compression": "bogus"}, "--compression: unknown codec 'bogus'"),
                    ({"out": tmp_path / "afile"}, "afile exists and is not a directory")]:
        out = kw.pop("out", tmp_path / "o")
        with pytest.raises(DataError, match=msg):
            _convert(tree, fixture_tokenizer, out, **kw)
        assert not (tmp_path / "o").exists()
    for content, msg in [("source_weights: {alpha: abc}", "weight of 'alpha' is not a number: 'abc'"),
                         ("source_weights: [1, 2]", "source_weights must be a mapping")]:
        (tmp_path / "w.yaml").write_text(content)
        with pytest.raises(DataError, match=msg):
            MixSpec.from_args(str(tmp_path / "w.yaml"))


def test_an_out_holding_something_else_is_not_replaced(tmp_path, txt360_tree, fixture_tokenizer, capsys):
    tree, _ = txt360_tree
    out = tmp_path / "out"
    first = _convert(tree, fixture_tokenizer, out)
    (out / "parts" / "my_own_stuff").mkdir()
    (out / "parts" / "my_own_stuff" / "keep.txt").write_text("mine")
    other = _tree(tmp_path / "other", {"web/1-1/0_1.jsonl": DOC * 40})
    index = (out / "index.json").read_text()
    with pytest.raises(DataError, match=r"holds a dataset converted with other settings \(input: .*--overwrite"):
        _convert(other, fixture_tokenizer, out)
    with pytest.raises(DataError, match=r"other settings \(seq_len: 16 -> 32\)"):
        convert_txt360(ConvertConfig(input=tree, out=out, tokenizer=str(fixture_tokenizer), seq_len=32,
                                     workers=1, progress=False))
    # refused before anything moved: the dataset is complete and unchanged
    assert (out / "index.json").read_text() == index and json.loads((out / "manifest.json").read_text()) == {
        k: v for k, v in first.items() if k != "_run"}
    capsys.readouterr()
    replaced = _convert(other, fixture_tokenizer, out, overwrite=True)
    assert set(replaced["sources"]) == {"web"}
    assert "removing 7 part(s)" in capsys.readouterr().err
    assert (out / "parts" / "my_own_stuff" / "keep.txt").read_text() == "mine"  # not the tool's to delete
    # a non-empty folder that holds no dataset at all
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("x")
    with pytest.raises(DataError, match=r"is not empty and holds no converted dataset \(\['notes.txt'\]\)"):
        _convert(tree, fixture_tokenizer, tmp_path / "home")
    assert sorted(p.name for p in (tmp_path / "home").iterdir()) == ["notes.txt"]  # untouched


def test_another_source_selection_or_mix_is_refused_not_pruned(tmp_path, fixture_tokenizer, capsys):
    """Converting source by source into one --out removed the earlier sources' finished parts ("note:
    removing 2 part(s) ... whose input file is no longer in ...", their files still there), and another
    --source-weights rewrote the published dataset in place; both are other settings now."""
    tree = _tree(tmp_path / "t", {"arxiv/1-1/0_1.jsonl": DOC * 40, "wiki/1-1/0_1.jsonl": DOC * 40})
    out = tmp_path / "out"
    _convert(tree, fixture_tokenizer, out, sources=["arxiv"])
    before = sorted(p.name for p in (out / "parts").iterdir())
    index = (out / "index.json").read_text()
    with pytest.raises(DataError, match=r"other settings \(--sources: \['arxiv'\] -> \['wiki'\]\); pass --overwrite"):
        _convert(tree, fixture_tokenizer, out, sources=["wiki"])
    with pytest.raises(DataError, match=r"other settings \(the mix \(--weights/--source-weights/--bucket-upsample\): "):
        _convert(tree, fixture_tokenizer, out, sources=["arxiv"], mix=MixSpec(source_weights={"arxiv": 2.0}))
    assert sorted(p.name for p in (out / "parts").iterdir()) == before and (out / "index.json").read_text() == index
    assert "removing" not in capsys.readouterr().err
    again = _convert(tree, fixture_tokenizer, out, sources=["arxiv"])  # the same selection: nothing to do
    assert again["_run"]["parts_skipped"] == again["_run"]["parts_total"] == 1
    both = _convert(tree, fixture_tokenizer, out, overwrite=True)  # widened on purpose: arxiv's part is reused
    assert set(both["sources"]) == {"arxiv", "wiki"} and both["_run"]["parts_skipped"] == 1


def test_nothing_packable_publishes_nothing(tmp_path, fixture_tokenizer):
    empty = _tree(tmp_path / "e", {"web/1-1/0_1.jsonl": json.dumps({"text": "  "}) + "\n" + DOC})
    out = tmp_path / "out"
    with pytest.raises(DataError, match=r"no sequence of 4096 tokens .*1 empty document\(s\) skipped.*"
                                        r"nothing was published") as err:
        convert_txt360(ConvertConfig(input=empty, out=out, tokenizer=str(fixture_tokenizer), seq_len=4096,
                                     workers=1, progress=False))
    # the counts travel with the error, for callers that word it for their own option (eval --seq-len)
    assert err.value.seq_len == 4096 and "1 empty document(s) skipped" in err.value.counts
    # concat packs each file on its own: said, since the document total alone may exceed a row (an audit)
    assert "each input file is packed on its own, and a file's tail under 4096 tokens is dropped" in str(err.value)
    assert not (out / "index.json").exists() and not (out / "manifest.json").exists()


def test_eval_set_flags_are_checked(tmp_path, txt360_tree, fixture_tokenizer):
    tree, _ = txt360_tree
    base = EvalSetsConfig(input=tree, out=tmp_path / "e", tokenizer=str(fixture_tokenizer), val_seq_len=16,
                          screen_seq_len=16, screen_sequences=2, progress=False)
    for change, msg in [({"val_seq_len": 0}, "--val-seq-len must be >= 2"),
                        ({"screen_seq_len": 1}, "--screen-seq-len must be >= 2"),
                        ({"screen_sequences": 0}, "--screen-sequences must be >= 1"),
                        ({"val_sequences_per_source": 0}, "--val-sequences-per-source must be >= 1"),
                        ({"max_files_per_source": 0}, "--max-files-per-source must be >= 1"),
                        ({"compression": "gzip"}, "--compression: unknown codec 'gzip'"),
                        ({"train_manifest": tmp_path / "nope.json"}, r"--train-manifest .*nope.json: cannot read")]:
        with pytest.raises(DataError, match=msg):
            build_eval_sets(dataclasses.replace(base, **change))
    assert not (tmp_path / "e").exists()
    (tmp_path / "bad.json").write_text("{oops")
    with pytest.raises(DataError, match=r"bad.json: cannot read"):
        build_eval_sets(dataclasses.replace(base, train_manifest=tmp_path / "bad.json"))


def test_make_synth_keeps_an_existing_tree_and_reads_k_ranges(tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_synth_cli", Path(__file__).parents[2] / "data_prep" /
                                                  "make_synth.py")
    make_synth = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_synth)
    root = tmp_path / "s"
    root.mkdir()
    (root / "heldout.jsonl").write_text("mine\n")
    assert make_synth.main(["--out", str(root), "--num-docs", "10", "--no-tokenizer"]) == 2
    assert "already holds ['heldout.jsonl']" in capsys.readouterr().err
    assert (root / "heldout.jsonl").read_text() == "mine\n"
    assert make_synth.main(["--out", str(tmp_path / "t"), "--eval-ks", "8-1"]) == 2
    assert "--eval-ks: range '8-1' runs backwards (write 1-8)" in capsys.readouterr().err
    shutil.rmtree(tmp_path / "t", ignore_errors=True)
