"""build_eval_sets.py never loses sets it built before. Before: a rerun into the same --out with another
--val-seq-len replaced val/ and screen/ silently (exit 0, no --overwrite); a run whose screen set could not
be filled exited 2 after val/ had already been rebuilt; an --out holding training shards got val/ inside
them; a failed build into an empty --out left val/ and .lock there."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path

import pytest

from megaloop.data import DataError
from megaloop.data._fsutil import file_lock, try_lock_fd
from megaloop.data.eval_sets import EvalSetsConfig, build_eval_sets
from megaloop.data.mds_convert import ConvertConfig, convert_txt360
from megaloop.data.txt360 import HoldoutSpec
from tests.data_prep.conftest import load_tool

HOLD = ["--val-fraction", "0.1", "--screen-fraction", "0.1"]


@pytest.fixture(scope="module")
def cli():
    return load_tool("build_eval_sets", "replace")


def _error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("note: ")]
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def _snapshot(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def _args(tree: Path, out: Path, tok: Path, *extra: str) -> list[str]:
    return ["--input", str(tree), "--out", str(out), "--tokenizer", str(tok), "--val-seq-len", "16",
            "--screen-seq-len", "16", "--screen-sequences", "2", "--workers", "1", "--no-progress", *HOLD, *extra]


def test_sets_built_with_other_settings_are_kept_unless_overwrite(cli, txt360_tree, fixture_tokenizer, tmp_path,
                                                                  capsys):
    tree, out = txt360_tree[0], tmp_path / "eval"
    assert cli.main(_args(tree, out, fixture_tokenizer)) == 0
    first = _snapshot(out)
    assert json.loads((out / "val" / "manifest.json").read_text())["settings"]["seq_len"] == 16
    # the same command again: a no-op, nothing rewritten
    assert cli.main(_args(tree, out, fixture_tokenizer)) == 0
    assert _snapshot(out) == first
    capsys.readouterr()
    # other settings: refused before any work, naming each set and difference
    assert cli.main(_args(tree, out, fixture_tokenizer, "--val-seq-len", "24", "--screen-sequences", "3")) == 2
    assert _error_line(capsys) == (f"error: --out {out} holds eval sets built with other settings: val/ (seq_len: "
                                   "16 -> 24), screen/ (sequences: 2 -> 3); pass --overwrite to replace them, or "
                                   "choose another --out")
    assert _snapshot(out) == first
    # --overwrite, but the screen set cannot be filled: fails before val/ is touched
    assert cli.main(_args(tree, out, fixture_tokenizer, "--val-seq-len", "24", "--screen-sequences", "100000",
                          "--overwrite")) == 2
    assert "LR-screen set needs 100000 x 16" in _error_line(capsys)
    assert _snapshot(out) == first
    assert sorted(p.name for p in out.iterdir()) == [".lock", "screen", "val"]  # no temporary folder left
    # --overwrite that succeeds replaces both
    assert cli.main(_args(tree, out, fixture_tokenizer, "--val-seq-len", "24", "--overwrite")) == 0
    assert json.loads((out / "val" / "manifest.json").read_text())["seq_len"] == 24
    assert sorted(p.name for p in out.iterdir()) == [".lock", "screen", "val"]


def test_an_out_that_is_not_an_eval_sets_folder_is_refused(cli, txt360_tree, fixture_tokenizer, tmp_path, capsys):
    tree = txt360_tree[0]
    train = tmp_path / "train"
    convert_txt360(ConvertConfig(input=tree, out=train, tokenizer=str(fixture_tokenizer), seq_len=16,
                                 holdout=HoldoutSpec(0.1, 0.1), progress=False))
    before = _snapshot(train)
    assert cli.main(_args(tree, train, fixture_tokenizer)) == 2
    assert _error_line(capsys) == (f"error: --out {train} holds a 'train' dataset (index.json, manifest.json, "
                                   "parts); the eval sets go into val/ and screen/ of a folder of their own: "
                                   "choose another --out")
    assert _snapshot(train) == before and not (train / "val").exists()
    # a val/ folder this tool did not write is never replaced
    mine = tmp_path / "mine"
    (mine / "val").mkdir(parents=True)
    (mine / "val" / "notes.txt").write_text("mine")
    assert cli.main(_args(tree, mine, fixture_tokenizer)) == 2
    assert f"{mine / 'val'} is not a val set written by this tool" in _error_line(capsys)
    assert sorted(p.name for p in mine.iterdir()) == ["val"] and (mine / "val" / "notes.txt").read_text() == "mine"


def test_a_failed_build_leaves_an_empty_out_empty(cli, txt360_tree, fixture_tokenizer, tmp_path, capsys):
    out = tmp_path / "empty"
    out.mkdir()
    assert cli.main(_args(txt360_tree[0], out, fixture_tokenizer, "--screen-sequences", "100000")) == 2
    assert "LR-screen set needs" in _error_line(capsys)
    assert list(out.iterdir()) == []  # no val/, no .lock


def test_a_set_moved_aside_by_an_interrupted_replacement_is_put_back(txt360_tree, fixture_tokenizer, tmp_path,
                                                                      capsys):
    cfg = EvalSetsConfig(input=txt360_tree[0], out=tmp_path / "eval", tokenizer=str(fixture_tokenizer),
                         holdout=HoldoutSpec(0.1, 0.1), val_seq_len=16, screen_seq_len=16, screen_sequences=2,
                         progress=False)
    first = build_eval_sets(cfg)
    (cfg.out / "val").rename(cfg.out / ".old-val-0000abcd")  # killed between its two renames
    (cfg.out / ".tmp-screen-0000abcd").mkdir()  # and a half-written set
    capsys.readouterr()
    again = build_eval_sets(cfg)
    assert f"note: {cfg.out / 'val'} restored" in capsys.readouterr().err
    assert again["val"]["fingerprint"] == first["val"]["fingerprint"]
    assert sorted(p.name for p in cfg.out.iterdir()) == [".lock", "screen", "val"]
    with pytest.raises(DataError, match=r"val/ \(seq_len: 16 -> 32\)"):
        build_eval_sets(dataclasses.replace(cfg, val_seq_len=32))


def test_a_lock_file_removed_by_its_holder_is_not_shared(tmp_path):
    """``file_lock(drop_if=...)`` removes the lock file on release; a process that waited on the removed
    file must lock the current one, not hold a lock nobody else can see."""
    path = tmp_path / "out" / ".lock"
    got = threading.Event()
    release = threading.Event()

    def waiter():
        with file_lock(path):
            got.set()
            release.wait(30)

    with file_lock(path, drop_if=lambda: True):
        t = threading.Thread(target=waiter)
        t.start()
        time.sleep(0.3)  # the waiter has opened the file and blocks on it
    assert got.wait(30)
    try:
        fd = try_lock_fd(path)  # a newcomer opens the path: the waiter must hold that file
        assert fd is None, "two holders of one lock"
    finally:
        release.set()
        t.join(30)
