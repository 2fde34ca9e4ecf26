"""``train.init_seed`` re-draws the initial weights alone; ``train.seed`` moves weights, depth draws
and data order together (the loader's shuffle seed is ``data.shuffle_seed + train.seed``)."""

from __future__ import annotations

import pytest
import torch

from megaloop.config import load_config
from megaloop.config_utils import ConfigError

pytestmark = pytest.mark.usefixtures("megatron_world", "one_thread")  # tests/conftest.py

SMALL = ["train.global_batch_size=4", "train.micro_batch_size=2", "train.max_steps=10",
         "optim.warmup_steps=1", "logging.progress=false", "depth.kind=pln", "depth.mean=5"]


def _start(tmp_path, name: str, *overrides: str) -> dict:
    """Initial weights, the first two batches and the first five depth plans of a fresh trainer."""
    from megaloop.model.build import unwrap
    from megaloop.train.trainer import Trainer

    t = Trainer(load_config("tiny", [*SMALL, *overrides]), tmp_path / name)
    t.setup()
    weights = {k: v.detach().clone() for k, v in unwrap(t.model[0]).state_dict().items()
               if isinstance(v, torch.Tensor) and v.is_floating_point()}
    tokens = torch.cat([next(t.loader_iter)["tokens"] for _ in range(2)])
    plans = [t.sampler.plan(step, t.M) for step in range(5)]
    t.loader.close()
    return {"weights": weights, "tokens": tokens, "plans": plans}


def _same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_init_seed_changes_only_the_weights(tmp_path):
    base = _start(tmp_path, "base", "train.seed=1234")
    same = _start(tmp_path, "same", "train.seed=1234", "train.init_seed=1234")
    other = _start(tmp_path, "other", "train.seed=1234", "train.init_seed=7")
    assert _same_weights(base["weights"], same["weights"])  # init_seed = seed: the default run
    assert not _same_weights(base["weights"], other["weights"])
    assert torch.equal(base["tokens"], other["tokens"])  # same batches ...
    assert base["plans"] == other["plans"]  # ... and the same depth draws
    reseeded = _start(tmp_path, "reseeded", "train.seed=7")
    assert not torch.equal(base["tokens"], reseeded["tokens"])  # train.seed moves the data order too
    assert _same_weights(other["weights"], reseeded["weights"])  # and the weights, as init_seed=7 does


def test_init_seed_validation():
    with pytest.raises(ConfigError, match="train.init_seed"):
        load_config("tiny", ["train.init_seed=-1"])
    with pytest.raises(ConfigError, match="train.seed"):
        load_config("tiny", ["train.seed=-3"])
