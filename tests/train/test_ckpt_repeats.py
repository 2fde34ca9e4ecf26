"""A rank that requests one tensor twice (parallel.vpp > 1: every model chunk holds the core) loads
each once and copies it, in dicts and in lists (Float16Optimizer's FP32 masters are lists of lists,
which megatron-core's loader compacts: a first fix shifted the items after a repeat)."""

from __future__ import annotations

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from megaloop.train.ckpt_io import in_process_write_queue
from megaloop.train.ckpt_repeats import fill_repeats, set_repeats_aside


def _st(key: str, t: torch.Tensor, replica: int = 0) -> ShardedTensor:
    return ShardedTensor.from_rank_offsets(key, t, replica_id=replica)


def _request(make) -> dict:
    """A model part keyed by name and an optimizer part in a list of lists, both holding core.w twice."""
    return {"model0": {"core.w": _st("core.w", make(1.0)), "prelude.w": _st("prelude.w", make(2.0))},
            "model1": {"core.w": _st("core.w", make(1.0), 1), "coda.w": _st("coda.w", make(3.0))},
            "optimizer": {"fp32": [[_st("o.core.w", make(4.0)), _st("o.prelude.w", make(5.0)),
                                    _st("o.core.w", make(4.0), 1), _st("o.coda.w", make(6.0))]]}}


def test_repeats_load_once_and_every_item_keeps_its_place(megatron_world, tmp_path):
    with in_process_write_queue():
        dist_checkpointing.save(_request(lambda v: torch.full((3,), v)), str(tmp_path))
    sd = _request(lambda v: torch.zeros(3))
    repeats = set_repeats_aside(sd)
    assert [r for r, _ in repeats.pairs] == [("model1", "core.w"), ("optimizer", "fp32", 0, 2)]
    loaded = dist_checkpointing.load(sd, str(tmp_path))
    fill_repeats(loaded, repeats)
    got = {k: float(v[0]) for k, v in {**loaded["model0"], **{f"1.{k}": v for k, v in loaded["model1"].items()}}.items()}
    assert got == {"core.w": 1.0, "prelude.w": 2.0, "1.core.w": 1.0, "1.coda.w": 3.0}
    fp32 = loaded["optimizer"]["fp32"]
    assert isinstance(fp32, list) and isinstance(fp32[0], list)
    assert [float(t[0]) for t in fp32[0]] == [4.0, 5.0, 4.0, 6.0]
    assert fp32[0][2] is not fp32[0][0]  # a copy: the chunks' parameters stay separate tensors


def test_without_repeats_nothing_changes():
    sd = {"model0": {"a": _st("a", torch.zeros(2))}, "optimizer": {"x": [[_st("b", torch.zeros(2))]]}}
    repeats = set_repeats_aside(sd)
    assert not repeats and isinstance(sd["optimizer"]["x"], list)


def test_an_interrupt_inside_the_reader_stays_an_interrupt(tmp_path):
    """torch's reader wraps a Ctrl-C as one rank's failure of a CheckpointException: it was reported as a
    damaged checkpoint ("KeyboardInterrupt on rank 0 (a missing or damaged *.distcp / .metadata file?)")."""
    import pytest
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    from megaloop.train.checkpoint import CheckpointError, raise_load_error

    with pytest.raises(KeyboardInterrupt):
        raise_load_error(CheckpointException("load failed", {0: _wrap_exception(KeyboardInterrupt())}), tmp_path)
    with pytest.raises(CheckpointError, match=r"could not be read"):  # any other failure: the one line
        raise_load_error(CheckpointException("load failed", {0: _wrap_exception(ValueError("bad bytes"))}), tmp_path)
