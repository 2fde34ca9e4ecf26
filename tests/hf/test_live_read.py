"""megaloop.hf.live_read.load_newest: reading a checkpoint of a run that prunes while it trains."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from megaloop.hf.live_read import load_newest
from megaloop.train.checkpoint import CheckpointError


def _step(root: Path, step: int) -> Path:
    d = root / f"step_{step:08d}"
    d.mkdir(parents=True)
    for name in (".metadata", "common.pt"):
        (d / name).write_bytes(b"x")
    (d / "megaloop.json").write_text(json.dumps({"step": step, "complete": True}))
    return d


def _pruning_load(root: Path, calls: list, prune: int):
    """A load_native that, for its first ``prune`` calls, sees its checkpoint pruned under it (the run
    saves a newer one and renames this one away), logging torch's fallback warning as dcp does."""

    def load(ckpt):
        calls.append(Path(ckpt).name)
        if len(calls) <= prune:
            _step(root, int(Path(ckpt).name[5:]) + 1)
            os.rename(ckpt, root / f".pruned_{Path(ckpt).name}")
            logging.getLogger().warning("Global metadata is not found. Falling back to rank local metadata.",
                                        exc_info=FileNotFoundError(2, "No such file", str(ckpt)))
            raise CheckpointError(f"checkpoint {ckpt} could not be read: {ckpt}/common.pt is damaged or truncated")
        return "model", ckpt

    return load


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.text = ""

    def emit(self, record: logging.LogRecord) -> None:
        self.text += record.getMessage() + "\n"


def test_a_newest_checkpoint_pruned_under_the_read_is_read_again(tmp_path, capsys):
    """--checkpoint RUN while the run trains: its newest step pruned during the read was called "damaged or
    truncated" (exit 2; 1 try in 6 at keep_checkpoints=1); the now-newest one is read, with a note."""
    root = tmp_path / "run" / "checkpoints"
    _step(root, 4)
    calls: list = []
    load = _pruning_load(root, calls, prune=1)
    caplog = _Records()
    logging.getLogger().addHandler(caplog)
    try:
        assert load_newest(tmp_path / "run", load) == ("model", root / "step_00000005")
        logging.getLogger().warning("after the read")
    finally:
        logging.getLogger().removeHandler(caplog)
    assert calls == ["step_00000004", "step_00000005"]
    err = capsys.readouterr().err
    assert f"note: {root / 'step_00000004'} was removed while it was read" in err, err
    assert "Global metadata" not in caplog.text  # torch's warning with a traceback is dropped during the read
    assert "after the read" in caplog.text  # ... and only then

    calls.clear()  # pruned every time: one line after `tries` reads
    with pytest.raises(CheckpointError, match="its newest checkpoint was removed while it was read, 3 times in a row"):
        load_newest(root, _pruning_load(root, calls, prune=9))


def test_a_step_folder_given_by_path_and_pruned_is_named_with_its_checkpoints_folder(tmp_path):
    root = tmp_path / "checkpoints"
    step = _step(root, 4)
    load = _pruning_load(root, [], prune=1)
    with pytest.raises(CheckpointError) as err:
        load_newest(step, load)
    assert str(err.value) == (f"checkpoint {step} was removed while it was read (removed: {root} now holds "
                              "step_00000005; a run training there prunes its older checkpoints, "
                              f"train.keep_checkpoints; pass {root} for its newest)")
    with pytest.raises(CheckpointError) as err:  # gone before the command reached it (it only said "does not exist")
        load_newest(step, load)
    assert str(err.value).startswith(f"checkpoint {step} does not exist (removed: {root} now holds step_00000005")
    for never in ("step_4", "step_00000009"):  # a typo, a step not written yet: no "removed"
        with pytest.raises(CheckpointError) as err:
            load_newest(root / never, load)
        assert str(err.value) == f"checkpoint {root / never} does not exist", err.value


def test_a_checkpoint_still_there_keeps_its_own_error(tmp_path):
    root = tmp_path / "checkpoints"
    _step(root, 4)

    def damaged(ckpt):
        raise CheckpointError("checkpoint X: common.pt is damaged or truncated")

    with pytest.raises(CheckpointError, match="^checkpoint X: common.pt is damaged or truncated$"):
        load_newest(root, damaged)
