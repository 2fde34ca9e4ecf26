"""Presets and the paper's arms (megaloop/configs/arms.yaml) validate at every scale."""

import pytest

from megaloop.config import load_config, paper_arms
from megaloop.config_utils import ConfigError

PRESETS = ["tiny", "S", "M", "L"]


@pytest.mark.parametrize("preset", PRESETS)
def test_every_arm_validates_on_every_preset(preset):
    for name, arm in paper_arms().items():
        cfg = load_config(preset, ["train.max_steps=1000"], arm=name)
        assert arm["about"]
        if name.startswith("untied"):
            assert not cfg.model.looped and cfg.depth.kind == "fixed"


def test_arms_say_what_the_paper_says():
    u64 = load_config("S", arm="u64").depth
    u10 = load_config("S", arm="u10").depth
    assert (u64.init, u64.reward, u64.target_mean) == ("uniform", "raw_ce", 5.0)  # raw-CE feedback
    assert (u10.init, u10.reward) == ("uniform_1_10", "raw_ce")
    assert load_config("S", arm="fixed5_b2").model.b_max == 2
    pln = load_config("tiny", arm="pln5").depth
    assert (pln.kind, pln.mean, pln.cap) == ("pln", 5.0, 64)
    assert load_config("S", arm="untied12").model.num_layers == 12


def test_untied_presets_train_at_fixed_depth():
    for preset in ("untied4", "untied12"):
        assert load_config(preset).depth.kind == "fixed"
    with pytest.raises(ConfigError, match="depth.kind"):  # refused when training starts
        load_config("untied4", ["depth.kind=learned"]).check_trainable()
    load_config("untied4").check_trainable()


def test_arms_file_is_not_a_preset():
    with pytest.raises(ConfigError, match="no such file or preset"):
        load_config("arms")
