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


def test_atomic_write_file_whole_with_the_umask_mode_or_the_old_file(tmp_path: Path) -> None:
    from megaloop.runtime.files import _umask, atomic_write_file

    path = tmp_path / "weights.bin"

    def fresh_0600(data: bytes):  # a writer that creates its file anew, 0600 (as safetensors' save_file)
        def write(name: str) -> None:
            os.unlink(name)
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        return write

    atomic_write_file(path, fresh_0600(b"new"))
    assert path.read_bytes() == b"new" and stat.S_IMODE(path.stat().st_mode) == 0o666 & ~_umask()
    assert [p.name for p in tmp_path.iterdir()] == ["weights.bin"]

    def torn(name: str) -> None:
        Path(name).write_bytes(b"ha")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write_file(path, torn)
    assert path.read_bytes() == b"new" and [p.name for p in tmp_path.iterdir()] == ["weights.bin"]

    import torch

    atomic_write_file(tmp_path / "state.pt", lambda name: torch.save({"step": 3}, name))
    assert torch.load(tmp_path / "state.pt", weights_only=True) == {"step": 3}


def test_save_figure_keeps_the_previous_figure_when_the_write_fails(tmp_path, monkeypatch):
    """A figure was written in place: a full disk or `ulimit -f` left a truncated PNG where the previous
    good one had been (eval sweep/synth --plot, lr-screen and reproduce reports)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure

    from megaloop.runtime.files import save_figure

    fig, ax = plt.subplots()
    ax.plot([1, 2, 3])
    out = save_figure(fig, tmp_path / "plot.png")
    good = out.read_bytes()
    assert good[:8] == b"\x89PNG\r\n\x1a\n"

    def full_disk(self, fname, **kw):
        with open(fname, "wb") as f:
            f.write(b"\x89PNG partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", full_disk)
    fig, _ = plt.subplots()
    with pytest.raises(OSError):
        save_figure(fig, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes() == good
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plot.png"]  # no temp file left
    monkeypatch.undo()
    fig, _ = plt.subplots()
    assert save_figure(fig, tmp_path / "p.svg").read_text().lstrip().startswith("<?xml")  # format from the suffix
