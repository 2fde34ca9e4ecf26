"""megaloop.post.runs.save_checkpoint: a post-training save cut short leaves no step folder behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megaloop.post.runs import latest_tag, save_checkpoint


class _Engine:
    """A PlainEngine stand-in whose save writes part of its file, then fails with ``error``."""

    rank, world, stage = 0, 1, None

    def __init__(self, error: BaseException | None = None):
        self.error = error

    def save(self, directory, tag, state) -> None:
        (Path(directory) / tag / "plain.pt.part").write_bytes(b"x")
        if self.error is not None:
            raise self.error
        (Path(directory) / "latest").write_text(tag)


@pytest.mark.parametrize("error", [KeyboardInterrupt(), OSError(28, "No space left on device")])
def test_a_save_cut_short_removes_the_step_folder_it_made(tmp_path, error):
    """A second Ctrl-C during the stop's save (or a failed write) left step000031/ empty or with its
    sidecar alone, for good; `latest` and the earlier steps stay as they were."""
    ckpt = tmp_path / "checkpoints"
    save_checkpoint(_Engine(), ckpt, "step000025", {"step": 25}, "rl_run.json", {"step": 25})
    with pytest.raises(type(error)):
        save_checkpoint(_Engine(error), ckpt, "step000031", {"step": 31}, "rl_run.json", {"step": 31})
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step000025"]
    assert latest_tag(ckpt) == "step000025"
    assert json.loads((ckpt / "step000025" / "rl_run.json").read_text()) == {"step": 25}


def test_a_failed_save_into_an_existing_step_folder_keeps_it(tmp_path):
    """A folder the save did not make (a step saved again) is not removed."""
    ckpt = tmp_path / "checkpoints"
    save_checkpoint(_Engine(), ckpt, "step000025", {"step": 25}, "rl_run.json", {"step": 25})
    (ckpt / "latest").write_text("step000020")
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(_Engine(KeyboardInterrupt()), ckpt, "step000025", {"step": 25}, "rl_run.json", {"step": 25})
    assert (ckpt / "step000025" / "rl_run.json").is_file()
