"""Input trees and output folders the data-prep tools used to misread, each refused in one line (exit 2)
before any work, and a converted dataset that stays published while an update of it runs.

What failed before, case by case, is in each test's docstring."""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import shutil
from pathlib import Path

import pytest

from megaloop.data import DataError
from megaloop.data import mds_convert
from megaloop.data.mds_convert import ConvertConfig, convert_txt360
from megaloop.data.txt360 import MixSpec, discover
from tests.data_prep.conftest import load_tool, write_text_file

DOC = json.dumps({"text": "The river runs north of the old city and under the golden bridge."}) + "\n"


@pytest.fixture(scope="module")
def tools():
    return {name: load_tool(name, "bad_trees") for name in ("txt360_to_mds", "build_eval_sets", "train_tokenizer")}


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        write_text_file(root / "data" / rel, text)
    return root


def _run(tools, tool: str, tree: Path, out: Path, tok: Path | None, *extra: str) -> int:
    args = {"txt360_to_mds": ["--tokenizer", str(tok), "--seq-len", "16", "--workers", "1", "--no-progress"],
            "build_eval_sets": ["--tokenizer", str(tok), "--val-seq-len", "16", "--workers", "1", "--no-progress"],
            "train_tokenizer": ["--vocab-size", "300"]}[tool]
    return tools[tool].main(["--input", str(tree), "--out", str(out), *args, *extra])


def test_a_source_folder_that_links_nowhere_is_refused(tools, tmp_path, fixture_tokenizer, capsys):
    """Before: a source folder under data/ that is a link to an unmounted disk was dropped without a word
    (``is_dir()`` is false for it), and ``--sources books`` then said "source 'books' not found"."""
    tree = _tree(tmp_path / "t", {"web/1-1/0_1.jsonl": DOC * 40})
    (tree / "data" / "books").symlink_to(tmp_path / "unmounted" / "books", target_is_directory=True)
    line = (f"error: 1 source folder(s) under {tree / 'data'} are links to folders that do not exist (an unmounted "
            f"disk?): {tree / 'data' / 'books'} -> {tmp_path / 'unmounted' / 'books'}; mount them, or remove the "
            "link(s) to go on without those sources")
    for extra in ([], ["--sources", "books"], ["--sources", "web,books"]):
        assert _run(tools, "txt360_to_mds", tree, tmp_path / "o", fixture_tokenizer, *extra) == 2
        assert _error_line(capsys) == line
        assert not (tmp_path / "o").exists()
    assert [f.source for f in discover(tree, ["web"])] == ["web"]  # a source not asked for is not read


def test_a_source_folder_with_a_dump_level_as_input_is_refused(tmp_path):
    """Before: ``--input tree/data/cc`` (cc holding CC-2013/1-1/...) was read as a data/ folder whose sources
    were the dumps: the README says a source folder as --input is refused."""
    tree = _tree(tmp_path / "tree", {"cc/CC-2013/1-1/0_1.jsonl": DOC, "cc/CC-2014/2-5/0_1.jsonl": DOC,
                                     "wiki/1-1/0_1.jsonl": DOC})
    with pytest.raises(DataError) as err:
        discover(tree / "data" / "cc")
    assert str(err.value) == (
        f"--input {tree / 'data' / 'cc'} is the source folder 'cc' of {tree / 'data'} (whose other sources hold "
        f"duplicate-bucket folders): its subfolders ['CC-2013', 'CC-2014'] would be read as sources; pass "
        f"{tree} (or {tree / 'data'}) and --sources cc to convert one source")
    assert {f.part for f in discover(tree, ["cc"])} == {"cc/CC-2013/1-1/0_1", "cc/CC-2014/2-5/0_1"}
    # a tree without a data/ level, not kept inside a data/ folder, is still read as one
    bare = tmp_path / "corpus"
    shutil.copytree(tree / "data", bare)
    assert len(discover(bare)) == 3


def test_an_out_that_cannot_be_created_is_one_line(tools, txt360_tree, fixture_tokenizer, tmp_path, capsys):
    """Before: ``--out afile/sub`` and ``--out /proc/self/mds`` ended the converter (and build_eval_sets) in a
    NotADirectoryError / FileNotFoundError traceback from ``mkdir``; train_tokenizer named its temporary
    folder (``/proc/self/.tok.train_tokenizer-tmp-PID``) instead of --out."""
    tree = txt360_tree[0]
    (tmp_path / "afile").write_text("x")
    sub = tmp_path / "afile" / "sub"
    for tool in tools:
        assert _run(tools, tool, tree, sub, fixture_tokenizer) == 2
        assert _error_line(capsys) == f"error: --out {sub}: {tmp_path / 'afile'} is a file, not a folder, so {sub} " \
                                      "cannot be created"
    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc")
    for tool in tools:
        assert _run(tools, tool, tree, Path("/proc/self/megaloop-out"), fixture_tokenizer) == 2
        assert _error_line(capsys).startswith("error: --out /proc/self/megaloop-out: not writable (no file can be "
                                              "created in /proc/self: ")


def test_an_out_inside_the_input_tree_is_refused(tools, fixture_tokenizer, tmp_path, capsys):
    """Before: ``--out TREE/data/out`` was accepted: the converter wrote its dataset there, and the next run
    read it as a source named 'out'."""
    tree = _tree(tmp_path / "tree", {"web/1-1/0_1.jsonl": DOC * 40})
    for tool in tools:
        out = tree / "data" / "out"
        assert _run(tools, tool, tree, out, fixture_tokenizer) == 2
        assert _error_line(capsys) == (f"error: --out {out} is inside the input tree ({tree / 'data'}): what it "
                                       f"writes there would be read as input by the next run; choose a folder "
                                       f"outside {tree / 'data'}")
        assert sorted(p.name for p in (tree / "data").iterdir()) == ["web"]


def test_files_that_are_not_jsonl_say_what_they_are(tools, fixture_tokenizer, tmp_path, capsys):
    """Before: a gzip file named .jsonl was "not UTF-8: byte 0x8b", a plain file named .gz "cannot read (Not a
    gzipped file ...)", and a line holding a JSON array "record has no 'text' field"."""
    gz = _tree(tmp_path / "gz", {"web/1-1/0_1.jsonl": ""})
    f = gz / "data" / "web" / "1-1" / "0_1.jsonl"
    f.write_bytes(gzip.compress(DOC.encode() * 5))
    assert _run(tools, "txt360_to_mds", gz, tmp_path / "o1", fixture_tokenizer) == 2
    assert _error_line(capsys) == (f"error: {f}: looks gzip-compressed (it starts with the gzip bytes 1f 8b) but is "
                                   "named .jsonl; rename it to 0_1.jsonl.gz")
    plain = _tree(tmp_path / "plain", {"web/1-1/0_1.jsonl": DOC})
    g = plain / "data" / "web" / "1-1" / "0_1.jsonl.gz"
    os.rename(plain / "data" / "web" / "1-1" / "0_1.jsonl", g)
    assert _run(tools, "txt360_to_mds", plain, tmp_path / "o2", fixture_tokenizer) == 2
    assert _error_line(capsys) == (f"error: {g}: named .gz but not gzip-compressed (it starts with b'{{\"'); "
                                   "rename it to 0_1.jsonl")
    arr = _tree(tmp_path / "arr", {"web/1-1/0_1.jsonl": DOC * 2 + '["a", "b"]\n'})
    assert _run(tools, "txt360_to_mds", arr, tmp_path / "o3", fixture_tokenizer) == 2
    assert _error_line(capsys) == (f"error: {arr / 'data' / 'web' / '1-1' / '0_1.jsonl'}:3: record is a JSON "
                                   "array, not an object with a 'text' field")


def test_a_gzip_file_with_bad_bytes_or_no_bytes_says_so(tools, fixture_tokenizer, tmp_path, capsys):
    """Before: a .jsonl.gz holding a non-UTF-8 byte was told to be renamed to .jsonl.gz.gz (TxT360 ships
    .jsonl.gz), and a 0-byte .jsonl.gz (an interrupted download) was read as an empty file."""
    tree = _tree(tmp_path / "t", {"web/1-1/0_1.jsonl": ""})
    f = tree / "data" / "web" / "1-1" / "0_1.jsonl.gz"
    os.rename(tree / "data" / "web" / "1-1" / "0_1.jsonl", f)
    f.write_bytes(gzip.compress(DOC.encode() + b'{"text": "bad \xff"}\n'))
    for tool in tools:
        assert _run(tools, tool, tree, tmp_path / f"o_{tool}", fixture_tokenizer) == 2
        err = _error_line(capsys)
        assert err.startswith(f"error: {f}:2: not UTF-8: byte 0xff at byte ") and ".gz.gz" not in err, err
    f.write_bytes(b"")
    for tool in tools:
        assert _run(tools, tool, tree, tmp_path / f"p_{tool}", fixture_tokenizer) == 2
        assert _error_line(capsys) == f"error: {f}: empty (0 bytes), not a gzip file (an interrupted download?)"


def test_bad_flags_are_one_line(tools, txt360_tree, fixture_tokenizer, tmp_path, capsys):
    """Before: a --weights file that is not YAML printed PyYAML's multi-line dump; ``--workers -4`` silently
    ran one worker; ``--train-manifest OUT/index.json`` (an MDS index) said "holdout spec ... differs"."""
    tree = txt360_tree[0]
    (tmp_path / "w.yaml").write_text("source_weights: [1,2\n")
    assert _run(tools, "txt360_to_mds", tree, tmp_path / "o", fixture_tokenizer, "--weights",
                str(tmp_path / "w.yaml")) == 2
    assert _error_line(capsys) == (f"error: weights file {tmp_path / 'w.yaml'}: not valid YAML (line 2, column 1): "
                                   "expected ',' or ']', but got '<stream end>'")
    for tool in ("txt360_to_mds", "build_eval_sets"):
        assert _run(tools, tool, tree, tmp_path / "o", fixture_tokenizer, "--workers", "-4") == 2
        assert _error_line(capsys) == "error: --workers must be >= 1, got -4"
    assert not (tmp_path / "o").exists()
    index = tmp_path / "index.json"
    index.write_text(json.dumps({"version": 2, "shards": []}))
    assert _run(tools, "build_eval_sets", tree, tmp_path / "e", fixture_tokenizer, "--train-manifest", str(index)) == 2
    assert _error_line(capsys) == (f"error: --train-manifest {index}: not a megaloop manifest (an MDS index.json); "
                                   "pass the manifest.json that data_prep/txt360_to_mds.py wrote in its --out")
    with pytest.raises(DataError, match=r"weights file .*w\.yaml: not valid YAML \(line 2, column 1\)"):
        MixSpec.from_args(str(tmp_path / "w.yaml"))


def test_train_tokenizer_says_when_the_vocabulary_is_smaller(tools, txt360_tree, tmp_path, capsys):
    """Before: ``--vocab-size 600`` on little text wrote a smaller tokenizer without a word on stderr."""
    assert tools["train_tokenizer"].main(["--input", str(txt360_tree[0]), "--out", str(tmp_path / "tok"),
                                          "--vocab-size", "100000", "--max-docs", "5"]) == 0
    cap = capsys.readouterr()
    vocab = len(json.loads((tmp_path / "tok" / "tokenizer.json").read_text())["model"]["vocab"])
    assert cap.err.strip() == (f"note: --vocab-size 100000: the tokenizer has {vocab} tokens (no other pair of tokens "
                               "occurs twice in the 5 document(s) read; more text gives more)")
    assert f"(vocab {vocab}," in cap.out


def _published(out: Path) -> dict[str, bytes]:
    """index.json, manifest.json and every shard index.json lists (all must exist)."""
    index = json.loads((out / "index.json").read_text())
    files = ["index.json", "manifest.json"] + [s["zip_data"]["basename"] if s.get("zip_data") else
                                               s["raw_data"]["basename"] for s in index["shards"]]
    return {f: (out / f).read_bytes() for f in files}


def test_an_interrupted_update_keeps_the_dataset_published(txt360_tree, fixture_tokenizer, tmp_path, monkeypatch,
                                                           capsys):
    """Before: a rerun that updates a converted dataset in place (changed input files) removed index.json and
    manifest.json first, so Ctrl-C during it left no dataset until a rerun finished."""
    tree = tmp_path / "tree"
    shutil.copytree(txt360_tree[0], tree)
    cfg = ConvertConfig(input=tree, out=tmp_path / "out", tokenizer=str(fixture_tokenizer), seq_len=16,
                        workers=1, progress=False)
    convert_txt360(cfg)
    before = _published(cfg.out)
    changed = tree / "data" / "beta" / "2-5" / "0_1.jsonl"
    changed.write_text(changed.read_text() + DOC * 30)
    write_text_file(tree / "data" / "beta" / "1-1" / "9_9.jsonl", DOC * 30)
    (tree / "data" / "alpha" / "1-1" / "1_2.jsonl").unlink()
    real, calls = mds_convert._process_part, []

    def interrupted(task):
        calls.append(task)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(task)

    monkeypatch.setattr(mds_convert, "_process_part", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert_txt360(cfg)
    assert _published(cfg.out) == before  # still the earlier dataset, whole
    assert not (cfg.out / ".tmp").exists()
    monkeypatch.setattr(mds_convert, "_process_part", real)
    # the same, killed while it published (between removing the old manifest and writing the new one)
    cut = tmp_path / "cut"
    shutil.copytree(cfg.out, cut)
    (cut / "manifest.json").unlink()
    fresh = convert_txt360(dataclasses.replace(cfg, out=tmp_path / "fresh"))
    for out in (cfg.out, cut):
        capsys.readouterr()
        man = convert_txt360(dataclasses.replace(cfg, out=out))
        assert man["_run"]["parts_skipped"] == man["_run"]["parts_total"] - 1  # the staged part was reused
        assert "removing 1 part(s)" in capsys.readouterr().err
        for key in ("total_tokens", "num_sequences", "sources", "fingerprint"):
            assert man[key] == fresh[key]
        assert sorted(p.name for p in out.iterdir()) == [".lock", "index.json", "manifest.json", "parts"]
        assert sorted(p.name for p in (out / "parts").iterdir()) == sorted(
            p.name for p in (tmp_path / "fresh" / "parts").iterdir())
