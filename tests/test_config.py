"""Presets and the paper's arms (megaloop/configs/arms.yaml) validate at every scale."""

import re
from pathlib import Path

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
    # a fixed depth other than 1 trained the one pass while metrics, summary and plots logged depth 7
    with pytest.raises(ConfigError, match=r"^depth\.depth: model\.arch=untied has no recurrence depth; it runs depth 1 "
                                          r"\(got 7\)"):
        load_config("untied4", ["depth.depth=7"]).check_trainable()


def test_an_fp8_recipe_without_fp8_is_refused_when_training_starts():
    """`model.fp8_recipe=delayed` without `model.fp8` trained in bf16/FP32 and recorded the recipe, no note."""
    with pytest.raises(ConfigError, match=r"^model\.fp8_recipe: 'delayed' is FP8's scaling recipe, but model\.fp8 is off"):
        load_config("tiny", ["model.fp8_recipe=delayed"]).check_trainable()
    load_config("tiny", ["model.fp8_recipe=delayed"])  # a saved config holding it still loads (eval)


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


def test_a_cap_override_below_a_learned_priors_r_max_is_refused():
    """`depth.cap=4` on tiny (learned prior over 1..16) was accepted and ignored; a preset's own cap
    (synth's 16, for its PLN law) does not stop a learned arm or a larger r_max."""
    for over in (["depth.cap=4"], ["depth={cap: 4}"]):
        with pytest.raises(ConfigError, match=r"^depth\.cap: 4 is below depth\.r_max=16, but depth\.kind=learned"):
            load_config("tiny", over)
    assert load_config("synth", arm="learned").depth.r_max == 64
    assert load_config("tiny", ["depth.r_max=32"]).depth.r_max == 32
    assert load_config("tiny", ["depth.kind=pln"]).depth.cap == 16
    assert load_config("tiny", ["depth.cap=16"]).depth.cap == 16
    # one above r_max was ignored as silently (the draws stayed in 1..16)
    with pytest.raises(ConfigError, match=r"^depth\.cap: 64 is above depth\.r_max=16, but depth\.kind=learned"):
        load_config("tiny", ["depth.cap=64"])


def test_a_target_mean_outside_the_priors_support_is_refused():
    """init=uniform_1_10 keeps the prior on 1..10; depth.target_mean=15 trained, and the mean penalty piled
    the prior onto depth 10 (p(10) = 0.99 after 300 updates)."""
    with pytest.raises(ConfigError, match=r"^depth\.target_mean: init=uniform_1_10 keeps the prior on depths 1\.\.10"):
        load_config("tiny", ["depth.init=uniform_1_10", "depth.target_mean=15"])
    assert load_config("tiny", ["depth.init=uniform_1_10", "depth.target_mean=10"]).depth.target_mean == 10


def test_a_files_new_name_overrides_its_bases_old_name(tmp_path):
    """A base file's ``b_max`` overwrote the child file's ``bptt_window`` (renaming ran on the merged
    YAML), and one file holding both names took the old one, silently."""
    from megaloop.config import CONFIG_DIR

    (tmp_path / "old.yaml").write_text(f"base: {CONFIG_DIR / 'tiny.yaml'}\nmodel: {{b_max: 10}}\n")
    (tmp_path / "child.yaml").write_text("base: old.yaml\nmodel: {bptt_window: 2}\n")
    assert load_config(str(tmp_path / "child.yaml")).model.bptt_window == 2
    (tmp_path / "child_old.yaml").write_text("base: old.yaml\nmodel: {hidden_size: 64}\n")
    assert load_config(str(tmp_path / "child_old.yaml")).model.bptt_window == 10
    both = tmp_path / "both.yaml"
    both.write_text(f"base: {CONFIG_DIR / 'tiny.yaml'}\nmodel: {{b_max: 3, bptt_window: 4}}\n")
    with pytest.raises(ConfigError, match=r"config file .*both\.yaml: model\.b_max: renamed to "
                                          r"model\.bptt_window; give only one"):
        load_config(str(both))


def test_a_folder_named_like_a_preset_does_not_hide_it(tmp_path, monkeypatch):
    """`megaloop train --run-dir tiny` made ./tiny; every later command started there (the default
    config is tiny) failed with "config file tiny is a directory", resume of that run included."""
    from megaloop.config import CONFIG_DIR, resolve_config_path

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()
    (tmp_path / "S").mkdir()
    assert resolve_config_path("tiny") == CONFIG_DIR / "tiny.yaml"
    assert load_config("S").model.hidden_size == load_config(str(CONFIG_DIR / "S.yaml")).model.hidden_size
    (tmp_path / "mine").mkdir()  # no preset of that name: still the folder, still refused
    with pytest.raises(ConfigError, match=r"^config file mine is a directory, not a YAML file"):
        load_config("mine")
    with pytest.raises(ConfigError, match=r"is a directory, not a YAML file"):
        load_config("./tiny")  # a path, spelled as one
    own = tmp_path / "M"
    own.write_text(f"base: {CONFIG_DIR / 'tiny.yaml'}\ntrain:\n  max_steps: 70\n")  # an existing file still wins over the preset
    assert resolve_config_path("M") == Path("M") and load_config("M").train.max_steps == 70


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
    # accepted, then failed later: at the first decay step (decay_style), in torch's Adam (betas, eps), as NaN
    # from step 1 (rope_base, norm_eps), in streaming (predownload hung, cache_limit), or out of memory/time
    ("optim.decay_style=cosin", "optim.decay_style: one of ('linear', 'cosine', 'exponential', 'minus_sqrt')"),
    ("optim.beta1=1.5", "optim.beta1: must be in [0, 1), got 1.5"),
    ("optim.beta2=1.0", "optim.beta2: must be in [0, 1), got 1.0"),
    ("optim.eps=-1", "optim.eps: must be > 0, got -1"),
    ("model.rope_base=0", "model.rope_base: must be > 0, got 0"),
    ("model.norm_eps=-1", "model.norm_eps: must be > 0, got -1"),
    ("model.state_init_std=-1", "model.state_init_std: must be >= 0, got -1"),
    ("model.deq_std=-1", "model.deq_std: must be >= 0, got -1"),
    ("model.seq_len=10000000", "model.seq_len: must be in [2, 4194304], got 10000000"),
    ("data.predownload=-5", "data.predownload: must be >= 1 or null"),
    ("data.cache_limit=10zz", "data.cache_limit: expected a size such as 50gb"),
    ("train.peak_tflops=-5", "train.peak_tflops: must be >= 0"),
    ("train.seed=18446744073709551616", "train.seed: must be in [0, 2**64)"),
    ("depth.cap=100000", "depth.cap: must be in [1, 1024], got 100000"),
    ("depth.sigma=100", "depth.sigma: must be in (0, 3], got 100"),
    ("depth.r_max=5000", "depth.r_max: must be in [1, 1024], got 5000"),
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


def test_values_a_training_run_would_ignore_or_jump_over_are_refused():
    """stop_after past the horizon trained to the horizon without a word; a warm-up overlapping the WSD
    decay made the LR jump down mid-warm-up (0.0015, 0.003, 0.001, 0 over four steps)."""
    for overrides, message in ((["train.max_steps=4", "optim.warmup_steps=1", "train.stop_after=5"],
                                "train.stop_after: 5 is past train.max_steps=4"),
                               (["train.max_steps=4", "optim.warmup_steps=2", "optim.decay_fraction=0.75"],
                                "optim.warmup_steps: 2 warm-up steps and the WSD decay's 3")):
        cfg = load_config("tiny", overrides)  # an old run's config still loads (evaluation)
        with pytest.raises(ConfigError, match=re.escape(message)):
            cfg.check_trainable()
    load_config("tiny", ["train.max_steps=4", "optim.warmup_steps=3", "train.stop_after=4"]).check_trainable()
    assert load_config("tiny", ["data.cache_limit=50gb", "data.predownload=8"]).data.cache_limit == "50gb"


def test_an_empty_arm_and_the_learned_arms_warm_up():
    """--arm "" (an unset $ARM) trained the preset's own depth prior; on tiny the learned arms other than
    `learned` kept the preset's 10 prior warm-up updates, not SPEC §5's 32."""
    with pytest.raises(ConfigError, match="--arm: empty name"):
        load_config("tiny", arm="")
    learned = [a for a in ("learned", "learned_h0", "learned_h005", "learned_h01", "learned_raw_ce", "learned_step",
                           "u64", "u10")]
    assert {load_config("tiny", arm=a).depth.warmup_updates for a in learned} == {32}
