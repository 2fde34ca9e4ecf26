"""A damaged checkpoint file is named in the one-line error.

Before: a truncated ``common.pt`` gave only torch's "PytorchStreamReader failed reading zip archive:
failed finding central directory. This is an internal miniz error ..." (no file name), and a truncated
``__0_0.distcp`` "EOFError on rank 0 (a missing or damaged *.distcp / .metadata file?)"; only a
missing ``*.distcp`` was named (through the FileNotFoundError's text).
"""

from __future__ import annotations

import re
import shutil

import pytest

from megaloop.train.checkpoint import CheckpointError, CheckpointManager
from tests.train.test_checkpoint import _chunks


@pytest.fixture
def saved(megatron_world, tmp_path):
    return CheckpointManager(tmp_path / "src").save(1, _chunks(), None, common={"step": 1})


def _truncate(f, size=100):
    f.write_bytes(f.read_bytes()[:size])


@pytest.mark.parametrize("name,damage,says", [
    ("common.pt", _truncate, r"is damaged or truncated \(RuntimeError: PytorchStreamReader failed reading zip "
                             r"archive: failed finding central directory\)$"),
    ("__0_0.distcp", _truncate, r"is truncated \(100 bytes; \.metadata places data up to byte \d+\)$"),
    ("__0_0.distcp", lambda f: _truncate(f, 0), r"is truncated \(0 bytes;"),
    ("__0_1.distcp", lambda f: f.unlink(), r"is missing$"),
], ids=["common.pt-truncated", "distcp-truncated", "distcp-empty", "distcp-missing"])
def test_the_damaged_file_is_named(saved, tmp_path, name, damage, says):
    ckpt = tmp_path / "copy" / saved.name
    shutil.copytree(saved, ckpt)
    damage(ckpt / name)
    before = sorted((p.name, p.stat().st_size) for p in ckpt.iterdir())
    with pytest.raises(CheckpointError) as err:
        CheckpointManager(ckpt.parent).load(ckpt, _chunks())
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"checkpoint {ckpt} could not be read: {ckpt / name} ")
    assert re.search(says, text), text
    assert "internal miniz error" not in text
    assert sorted((p.name, p.stat().st_size) for p in ckpt.iterdir()) == before  # nothing changed


def test_the_export_names_an_empty_common_pt(saved, tmp_path):
    """``megaloop convert`` / eval read common.pt on their own (megaloop.hf.convert.read_common):
    an empty one said only "common.pt could not be read: EOFError: "."""
    from megaloop.hf.convert import read_common

    ckpt = tmp_path / "copy" / saved.name
    shutil.copytree(saved, ckpt)
    (ckpt / "common.pt").write_bytes(b"")
    with pytest.raises(CheckpointError) as err:
        read_common(ckpt)
    assert f"{ckpt / 'common.pt'} is damaged or truncated (EOFError" in str(err.value), str(err.value)


def test_a_run_whose_checkpoints_are_all_incomplete_names_the_newest(saved, tmp_path):
    """eval/convert/--resume on a run whose only step_* lost a file said "is not a megaloop checkpoint"."""
    from megaloop.train.checkpoint import META, find_checkpoint

    run = tmp_path / "run"
    shutil.copytree(saved, run / "checkpoints" / saved.name)
    (run / "checkpoints" / saved.name / META).unlink()
    for where in (run, run / "checkpoints"):
        with pytest.raises(CheckpointError) as err:
            find_checkpoint(where)
        assert str(err.value) == (f"{where} holds no complete checkpoint: {run / 'checkpoints' / saved.name} is "
                                  f"incomplete (missing {META}: a partial copy, or files deleted?)"), str(err.value)
    shutil.rmtree(run / "checkpoints")
    with pytest.raises(CheckpointError, match="is not a megaloop checkpoint"):
        find_checkpoint(run)


@pytest.mark.parametrize("text,says", [("{\"step\": 1", "is unreadable (JSONDecodeError)"),
                                       ("[1]", "holds a JSON list, not the save's record")],
                         ids=["truncated", "not-an-object"])
def test_a_damaged_megaloop_json_is_named_by_every_reader(saved, tmp_path, text, says):
    """find_checkpoint (convert, eval, generate, train.init_weights) accepted a megaloop.json that did
    not parse; only --resume checked it. Named for a step dir and for the run dir around it."""
    from megaloop.hf.convert import load_native
    from megaloop.train.checkpoint import META, find_checkpoint

    run = tmp_path / "run"
    ckpt = run / "checkpoints" / saved.name
    shutil.copytree(saved, ckpt)
    (ckpt / META).write_text(text)
    for where in (ckpt, run, run / "checkpoints"):
        with pytest.raises(CheckpointError) as err:
            find_checkpoint(where)
        assert str(err.value).startswith(f"checkpoint {ckpt}: {META} {says}"), str(err.value)
        assert "not written by a finished save" in str(err.value)
    with pytest.raises(CheckpointError, match=re.escape(f"{META} {says}")):
        load_native(run)  # the converter's reader
    assert (ckpt / META).read_text() == text  # nothing rewritten
