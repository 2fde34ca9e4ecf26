"""Atomic writes (megaloop/runtime/files.py): whole file or the old one, no temp files left, and
the mode a plain ``open`` gives (results and checkpoints metadata are shared on clusters)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from megaloop.runtime.files import atomic_write_json, atomic_write_text


def test_mode_follows_the_umask_and_nothing_is_left_behind(tmp_path: Path) -> None:
    path = tmp_path / "results.json"
    atomic_write_json(path, {"a": 1})
    assert path.read_text() == '{\n  "a": 1\n}\n'
    mask = os.umask(0o022)
    os.umask(mask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~mask
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_a_failed_write_keeps_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    atomic_write_text(path, "old\n")

    class Boom:
        pass

    with pytest.raises(TypeError):
        atomic_write_json(path, {"x": Boom()})  # not JSON-serialisable: fails before anything is written
    with pytest.raises(TypeError):
        atomic_write_text(path, Boom())  # type: ignore[arg-type]  (fails inside the write, after mkstemp)
    assert path.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["state.json"]
