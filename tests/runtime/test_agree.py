"""megaloop.runtime.agree.on_every_rank over a real two-process gloo group: a set-up failure on one
rank stops both alike (the same class and line, naming the rank); a bug keeps its own traceback."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp


def _worker(rank: int, init: str, case: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    from megaloop.data.errors import DataError
    from megaloop.runtime.agree import on_every_rank

    def step() -> None:
        if rank == 1 and case == "user":
            raise DataError("MDS shard s1 is corrupt")
        if rank == 1 and case == "bug":
            raise KeyError("oops")

    try:
        on_every_rank(step)
        result = "ok"
    except Exception as err:  # noqa: BLE001 - recorded for the test
        result = f"{type(err).__name__}|{err}"
    with open(f"{out}.{rank}", "w") as f:
        f.write(result)
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("case", ["none", "user", "bug"])
def test_a_failure_on_one_rank_stops_every_rank(tmp_path, case):
    out = str(tmp_path / "result")
    mp.spawn(_worker, args=(f"file://{tmp_path / 'store'}", case, out), nprocs=2, join=True)
    got = [open(f"{out}.{r}").read() for r in (0, 1)]
    if case == "none":
        assert got == ["ok", "ok"]
    elif case == "user":
        assert got == ["DataError|MDS shard s1 is corrupt (found by rank 1)"] * 2
    else:
        assert got[1] == "KeyError|'oops'"  # the bug itself, on the rank that had it
        assert got[0].startswith("UserError|rank 1 failed during set-up (KeyError: 'oops')")


def test_a_single_process_raises_its_own_error():
    from megaloop.config_utils import ConfigError
    from megaloop.runtime.agree import on_every_rank

    err = ConfigError("model.x: bad")

    def step() -> None:
        raise err

    with pytest.raises(ConfigError) as got:
        on_every_rank(step)
    assert got.value is err
