"""DepthConfig validation names the offending field."""

from __future__ import annotations

import pytest

from megaloop.config_utils import ConfigError, from_dict
from megaloop.depth.config import DepthConfig


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"kind": "zipf"}, "depth.kind"),
        ({"reward": "ppl"}, "depth.reward"),
        ({"init": "zipf"}, "depth.init"),
        ({"kind": "pln", "mean": 1.0}, "depth.mean"),
        ({"kind": "pln", "mean": 64.0, "cap": 64}, "depth.mean"),
        ({"sigma": 0.0}, "depth.sigma"),
        ({"kind": "learned", "init": "uniform_1_10", "r_max": 8, "target_mean": 4.0}, "depth.r_max"),
        ({"kind": "learned", "init": "pln", "r_max": 5}, "depth.mean"),
        ({"kind": "learned", "target_mean": 80.0}, "depth.target_mean"),
        ({"beta2": 1.0}, "depth.beta2"),
        ({"mean_coef": -1.0}, "depth.mean_coef"),
        ({"entropy_coef": -0.1}, "depth.entropy_coef"),
        ({"ema_decay": 1.0}, "depth.ema_decay"),
        ({"warmup_updates": -1}, "depth.warmup_updates"),
        ({"depth": 0}, "depth.depth"),
    ],
)
def test_validation_names_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        DepthConfig(**kwargs)


def test_from_dict_unknown_and_typed_fields() -> None:
    with pytest.raises(ConfigError, match=r"depth\.prior_lr"):
        from_dict(DepthConfig, {"prior_lr": 1.0}, prefix="depth")
    with pytest.raises(ConfigError, match=r"depth\.r_max"):
        from_dict(DepthConfig, {"r_max": "lots"}, prefix="depth")
    cfg = from_dict(DepthConfig, {"kind": "learned", "init": "uniform_1_10", "reward": "raw_ce"}, prefix="depth")
    assert cfg.max_depth == 64
    assert DepthConfig(kind="poisson", cap=12).max_depth == 12 and DepthConfig(kind="fixed", depth=3).max_depth == 3


def test_defaults_valid() -> None:
    for kind in ("fixed", "pln", "learned"):
        DepthConfig(kind=kind)
