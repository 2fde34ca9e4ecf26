"""Folders of a TxT360 tree that are symlinks (e.g. ``data/common-crawl/CC-MAIN-2013-20 -> /other/disk/...``)
are read like real ones by every tool that discovers files (converter, eval sets, tokenizer training); a link
that loops or reaches a folder a second time is not followed and is named on stderr."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

from megaloop.data.eval_sets import EvalSetsConfig, build_eval_sets
from megaloop.data.mds_convert import ConvertConfig, convert_txt360
from megaloop.data.txt360 import HoldoutSpec, discover
from tests.data_prep.conftest import make_doc, write_text_file

HOLD = HoldoutSpec(val_fraction=0.3, screen_fraction=0.3)
FILES = {"CC-MAIN-2013-20/1-1/0_1.jsonl": 30, "CC-MAIN-2013-48/2-5/0_1.jsonl": 30}


def _docs(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return "".join(json.dumps({"text": make_doc(rng)}) + "\n" for _ in range(n))


def _trees(tmp: Path) -> tuple[Path, Path]:
    """The same documents twice: ``flat`` with real folders, ``linked`` whose source ``cc`` holds only
    links to dump folders kept elsewhere, plus a link looping to its own folder and a second link to a
    dump that is already linked."""
    flat, linked, store = tmp / "flat", tmp / "linked", tmp / "store"
    for i, (rel, n) in enumerate(FILES.items()):
        write_text_file(flat / "data" / "cc" / rel, _docs(n, i))
        write_text_file(store / rel, _docs(n, i))
    for root in (flat, linked):
        write_text_file(root / "data" / "wiki" / "1-1" / "0_1.jsonl", _docs(30, 9))
    (linked / "data" / "cc").mkdir()
    for dump in ("CC-MAIN-2013-20", "CC-MAIN-2013-48"):
        (linked / "data" / "cc" / dump).symlink_to(store / dump, target_is_directory=True)
    (linked / "data" / "cc" / "same-again").symlink_to(store / "CC-MAIN-2013-20", target_is_directory=True)
    (store / "CC-MAIN-2013-20" / "1-1" / "loop").symlink_to("..", target_is_directory=True)
    return flat, linked


def test_discovery_follows_linked_folders_once(tmp_path, capsys):
    flat, linked = _trees(tmp_path)
    capsys.readouterr()
    found = {f.part: f.bucket for f in discover(linked)}
    err = capsys.readouterr().err
    assert found == {f.part: f.bucket for f in discover(flat)} == {
        "cc/CC-MAIN-2013-20/1-1/0_1": "1-1", "cc/CC-MAIN-2013-48/2-5/0_1": "2-5", "wiki/1-1/0_1": "1-1"}
    assert "has no .jsonl" not in err
    cc = linked / "data" / "cc"
    assert (f"1 link(s) lead to a folder above them and are not followed (they would loop): "
            f"['{cc / 'CC-MAIN-2013-20' / '1-1' / 'loop'} -> {cc / 'CC-MAIN-2013-20'}']") in err
    assert (f"1 folder(s) lead to a folder already read under another path and are not read twice: "
            f"['{cc / 'same-again'} -> {cc / 'CC-MAIN-2013-20'}']") in err
    # a link to the data folder itself, or to another source, is not read again either
    (cc / "CC-MAIN-2013-48" / "up").symlink_to(linked / "data", target_is_directory=True)
    (linked / "data" / "wiki-too").symlink_to(linked / "data" / "wiki", target_is_directory=True)
    capsys.readouterr()
    assert len(discover(linked)) == 3
    err = capsys.readouterr().err
    assert "2 link(s) lead to a folder above them" in err and f"{linked / 'data' / 'wiki-too'} ->" in err


def test_converter_and_eval_sets_read_linked_folders(tmp_path, fixture_tokenizer):
    flat, linked = _trees(tmp_path)
    man = {}
    for name, tree in (("flat", flat), ("linked", linked)):
        man[name] = convert_txt360(ConvertConfig(input=tree, out=tmp_path / f"train-{name}", seq_len=16,
                                                 tokenizer=str(fixture_tokenizer), holdout=HOLD,
                                                 workers=1, progress=False))
    assert man["linked"]["source_tokens"] == man["flat"]["source_tokens"] and man["flat"]["source_tokens"]["cc"] > 0
    assert man["linked"]["num_parts"] == 3
    ev = {}
    for name, tree in (("flat", flat), ("linked", linked)):
        ev[name] = build_eval_sets(EvalSetsConfig(
            input=tree, out=tmp_path / f"eval-{name}", tokenizer=str(fixture_tokenizer), holdout=HOLD,
            val_seq_len=16, val_sequences_per_source=4, screen_seq_len=16, screen_sequences=2, workers=1,
            progress=False))
    assert ev["linked"]["val"]["sources"] == ev["flat"]["val"]["sources"]
    assert ev["linked"]["val"]["sources"]["cc"]["num_sequences"] > 0


def test_train_tokenizer_reads_a_source_made_of_linked_folders(tmp_path, capsys):
    _, linked = _trees(tmp_path)
    (linked / "data" / "wiki" / "1-1" / "0_1.jsonl").unlink()  # only the linked cc dumps hold documents
    spec = importlib.util.spec_from_file_location("train_tokenizer_links_under_test",
                                                  Path(__file__).parents[2] / "data_prep" / "train_tokenizer.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--input", str(linked), "--out", str(tmp_path / "tok"), "--vocab-size", "300",
                     "--max-docs", "40"]) == 0, capsys.readouterr().err
    assert (tmp_path / "tok" / "tokenizer.json").is_file()


def test_a_second_path_to_a_file_is_read_once(tmp_path, capsys):
    """A link to a file of the tree (here filed under another source and bucket), or a hard link, is
    not read a second time (it would train those documents again under another source's weight);
    a link to a file kept outside the tree is read, as a linked folder is."""
    flat, _ = _trees(tmp_path)
    data = flat / "data"
    (data / "wiki" / "1-1" / "linked.jsonl").symlink_to(data / "cc" / "CC-MAIN-2013-48" / "2-5" / "0_1.jsonl")
    (data / "wiki" / "1-1" / "hard.jsonl").hardlink_to(data / "cc" / "CC-MAIN-2013-20" / "1-1" / "0_1.jsonl")
    outside = tmp_path / "elsewhere.jsonl"
    outside.write_text(_docs(5, 7))
    (data / "wiki" / "1-1" / "outside.jsonl").symlink_to(outside)
    capsys.readouterr()
    parts = sorted(f.part for f in discover(flat))
    err = capsys.readouterr().err
    assert parts == ["cc/CC-MAIN-2013-20/1-1/0_1", "cc/CC-MAIN-2013-48/2-5/0_1", "wiki/1-1/0_1", "wiki/1-1/outside"]
    assert "2 file(s) are a second path to a file already read and are not read twice" in err
    assert f"{data / 'wiki' / '1-1' / 'linked.jsonl'} -> {data / 'cc' / 'CC-MAIN-2013-48' / '2-5' / '0_1.jsonl'}" in err
    # the real file wins over a link to it, whichever sorts first
    (data / "cc" / "CC-MAIN-2013-20" / "1-1" / "0_1.jsonl").unlink()
    (data / "aaa" / "1-1").mkdir(parents=True)
    (data / "aaa" / "1-1" / "first.jsonl").symlink_to(data / "wiki" / "1-1" / "hard.jsonl")
    capsys.readouterr()
    parts = sorted(f.part for f in discover(flat))
    assert "wiki/1-1/hard" in parts and "aaa/1-1/first" not in parts
