"""Presets and the paper's arms (megaloop/configs/arms.yaml) validate at every scale."""

import re

import pytest

from megaloop.config import load_config, paper_arms
from megaloop.config_utils import ConfigError, from_dict
from megaloop.model.config import ModelConfig

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
    assert load_config("S", arm="fixed5_b2").model.bptt_window == 2
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


def test_renamed_field_still_reads_its_old_name(tmp_path):
    """``model.b_max`` (before the TBPTT window was named ``bptt_window``) in an override, a YAML
    or an old checkpoint's config.yaml."""
    assert load_config("tiny", ["model.b_max=3"]).model.bptt_window == 3
    old = tmp_path / "old.yaml"
    old.write_text("model:\n  b_max: 2\n  hidden_size: 64\n  num_heads: 4\n")
    assert load_config(str(old)).model.bptt_window == 2
    assert load_config("tiny", ["model.b_max=3", "model.bptt_window=4"]).model.bptt_window == 4  # last wins
    with pytest.raises(ConfigError, match=r"model\.b_max: renamed to model\.bptt_window; give only one"):
        from_dict(ModelConfig, {"b_max": 2, "bptt_window": 3}, "model")  # one mapping holding both


def test_malformed_yaml_files_and_values_are_named(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  hidden_size: [1,\n")
    with pytest.raises(ConfigError, match=rf"^config file {bad}: not valid YAML \(line \d+, column \d+\)"):
        load_config(str(bad))
    with pytest.raises(ConfigError, match=rf"^config file {tmp_path} is a directory, not a YAML file"):
        load_config(str(tmp_path))
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"model:\n  hidden_size: \xff\xfe\n")
    with pytest.raises(ConfigError, match=rf"^config file {binary}: not UTF-8 text"):
        load_config(str(binary))
    with pytest.raises(ConfigError, match=r"^override model.hidden_size: '\[1,' is not a valid YAML value"):
        load_config("tiny", ["model.hidden_size=[1,"])


@pytest.mark.parametrize("override,message", [
    ("optim.lr=inf", "optim.lr: expected a finite number, got inf"),
    ("optim.min_lr=nan", "optim.min_lr: expected a finite number, got nan"),
    ("train.max_steps=inf", "train.max_steps: expected an integer, got inf"),
    ("train.max_steps=.nan", "train.max_steps: expected an integer, got nan"),
    # a negative eval_interval used to validate after every step; log_interval <= 0 logged every step
    ("train.eval_interval=-1", "train.eval_interval: must be >= 0 (0 = only at the end), got -1"),
    ("train.log_interval=0", "train.log_interval: must be >= 1, got 0"),
    ("train.max_nonfinite=-2", "train.max_nonfinite: must be >= 0 (0 = stop at the first), got -2"),
])
def test_bad_numbers_are_refused_naming_the_field(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("tiny", [override])


@pytest.mark.parametrize("overrides,message", [
    # an unknown split used to be found at the first validation, after training steps, named as data.path
    (["data.val_path=default:foo"], "data.val_path: unknown embedded split 'foo'"),
    (["data.path=default:tain"], "data.path: unknown embedded split 'tain'"),
    # validation on the split being trained on used to run silently
    (["data.val_path=default:train"], "data.val_path: default:train is the embedded corpus's train split, "
                                      "which data.path=default trains on"),
    (["data.path=default:val", "data.val_path=default"], "data.val_path: default is the embedded corpus's val split"),
])
def test_embedded_splits_are_checked_with_the_config(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("tiny", overrides)
    # held-out or other splits pass
    for ok in (["data.val_path=default:val"], ["data.val_path=default:screen"], ["data.path=/x", "data.val_path=default:train"]):
        assert load_config("tiny", ok).data.val_path == ok[-1].split("=", 1)[1]
