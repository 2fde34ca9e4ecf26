"""data_prep/train_tokenizer.py and build_eval_sets.py: bad flags refused with one line naming the flag,
an --out's tokenizer never replaced silently (atomic when it is), and a failed build leaves no folder
it created (and keeps what was there)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.data_prep.conftest import load_tool



def _script(name: str):
    return load_tool(name, "cli")


@pytest.fixture(scope="module")
def train_tokenizer():
    return _script("train_tokenizer")


@pytest.fixture(scope="module")
def build_eval_sets():
    return _script("build_eval_sets")


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.mark.parametrize("flags, message", [
    (["--max-docs", "-1"], "error: --max-docs must be >= 1, got -1"),
    (["--max-docs", "0"], "error: --max-docs must be >= 1, got 0"),
    (["--vocab-size", "-5"], "error: --vocab-size must be > 259 (the 256 byte symbols and 3 special tokens"),
    (["--vocab-size", "0"], "error: --vocab-size must be > 259"),
    (["--vocab-size", "10"], "error: --vocab-size must be > 259"),
    (["--vocab-size", "259"], "error: --vocab-size must be > 259"),
])
def test_train_tokenizer_refuses_bad_flags(train_tokenizer, txt360_tree, tmp_path, capsys, flags, message):
    out = tmp_path / "tok"
    assert train_tokenizer.main(["--input", str(txt360_tree[0]), "--out", str(out), *flags]) == 2
    assert _error_line(capsys).startswith(message)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written


def test_train_tokenizer_out_is_never_replaced_silently(train_tokenizer, txt360_tree, tmp_path, capsys,
                                                        monkeypatch):
    tree = str(txt360_tree[0])
    (tmp_path / "afile").write_text("x")
    assert train_tokenizer.main(["--input", tree, "--out", str(tmp_path / "afile"), "--vocab-size", "300"]) == 2
    assert _error_line(capsys) == f"error: --out {tmp_path / 'afile'} is a file, not a directory"
    out = tmp_path / "new" / "tok"
    assert train_tokenizer.main(["--input", tree, "--out", str(out), "--vocab-size", "300"]) == 0
    first = (out / "tokenizer.json").read_bytes()
    assert sorted(p.name for p in out.iterdir()) == ["special_tokens_map.json", "tokenizer.json",
                                                     "tokenizer_config.json"]
    assert train_tokenizer.main(["--input", tree, "--out", str(out), "--vocab-size", "300"]) == 0  # the same one
    capsys.readouterr()
    assert train_tokenizer.main(["--input", tree, "--out", str(out), "--vocab-size", "320"]) == 2
    line = _error_line(capsys)
    assert f"--out {out} already holds a different tokenizer.json" in line and "--overwrite" in line
    assert (out / "tokenizer.json").read_bytes() == first
    assert train_tokenizer.main(["--input", tree, "--out", str(out), "--vocab-size", "320", "--overwrite"]) == 0
    assert (out / "tokenizer.json").read_bytes() != first
    # written beside --out and renamed: an interrupted training leaves --out as it was
    import megaloop.data.tokenizer as tokenizer_mod

    def interrupted(texts, out_dir, **kw):
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "tokenizer.json").write_text("half")
        raise KeyboardInterrupt

    now = (out / "tokenizer.json").read_bytes()
    monkeypatch.setattr(tokenizer_mod, "train_bytelevel_bpe", interrupted)
    assert train_tokenizer.main(["--input", tree, "--out", str(out), "--vocab-size", "300", "--overwrite"]) == 130
    assert (out / "tokenizer.json").read_bytes() == now
    assert sorted(p.name for p in out.parent.iterdir()) == ["tok"]  # no temporary folder left
    assert train_tokenizer.main(["--input", tree, "--out", str(tmp_path / "x" / "y"), "--vocab-size", "300"]) == 130
    assert not (tmp_path / "x").exists()


def test_a_failed_eval_set_build_leaves_no_folder_it_created(build_eval_sets, txt360_tree, fixture_tokenizer,
                                                             tmp_path, capsys):
    def run(out: Path) -> int:
        return build_eval_sets.main(["--input", str(txt360_tree[0]), "--out", str(out), "--tokenizer",
                                     str(fixture_tokenizer), "--val-seq-len", "100000", "--workers", "1",
                                     "--no-progress"])

    assert run(tmp_path / "new" / "eval") == 2
    assert "no validation sequence" in _error_line(capsys)
    assert not (tmp_path / "new").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    assert run(kept) == 2
    assert (kept / "notes.txt").read_text() == "mine"  # an --out that was there stays, with its files
    assert run(kept / "sub") == 2 and not (kept / "sub").exists()


def test_a_killed_tokenizer_runs_temp_folder_is_removed_by_the_next_run(tmp_path, txt360_tree):
    """A SIGKILLed train_tokenizer.py left `.OUT.train_tokenizer-tmp-PID/` (a whole tokenizer) beside --out
    for good; the next run removes those of processes that are gone, not a running one's."""
    import socket
    import subprocess
    import sys

    from tests.conftest import ROOT, clean_env

    tree, _ = txt360_tree
    out = tmp_path / "tok"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    stale = tmp_path / f".tok.train_tokenizer-tmp-{host}-{dead.pid}"
    live = tmp_path / f".tok.train_tokenizer-tmp-{host}-{os.getpid()}"
    other_host = tmp_path / f".tok.train_tokenizer-tmp-elsewhere-{dead.pid}"  # a shared filesystem's
    for d in (stale, live, other_host):
        d.mkdir()
        (d / "tokenizer.json").write_text("{}")
    proc = subprocess.run([sys.executable, str(ROOT / "data_prep" / "train_tokenizer.py"), "--input", str(tree),
                           "--out", str(out), "--vocab-size", "300"], env=clean_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (out / "tokenizer.json").is_file() and not stale.exists() and live.exists() and other_host.exists()


def test_train_tokenizer_max_docs_takes_every_source_in_turn(train_tokenizer, txt360_tree, tmp_path, capsys):
    """--max-docs read the sorted files in turn: a capped run on a TxT360 tree trained on its first
    source alone (here: alpha's 220 documents before beta's first)."""
    assert train_tokenizer.main(["--input", str(txt360_tree[0]), "--out", str(tmp_path / "tok"),
                                 "--vocab-size", "300", "--max-docs", "101"]) == 0
    out = capsys.readouterr().out
    assert "read 101 document(s): alpha 51, beta 50" in out
    # a source that runs out leaves its share to the others; the whole tree is still read without a cap
    assert train_tokenizer.main(["--input", str(txt360_tree[0]), "--out", str(tmp_path / "all"),
                                 "--vocab-size", "300"]) == 0
    assert "read 410 document(s): alpha 220, beta 190" in capsys.readouterr().out
