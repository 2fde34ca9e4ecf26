"""ModelConfig's checkpoint-compatibility helpers (megaloop/model/config.py)."""

from __future__ import annotations

from megaloop.model.config import ModelConfig, arch_differences


def test_arch_differences_names_changed_fields_and_reads_missing_ones_as_legacy():
    cfg = ModelConfig(hidden_size=64, num_heads=4)
    saved = {k: getattr(cfg, k) for k in ModelConfig.ARCH_FIELDS}
    assert arch_differences(saved, cfg) == []
    assert arch_differences({**saved, "qk_norm": False, "n_core": 3}, cfg) == [("n_core", 3, 2), ("qk_norm", False, True)]
    # a config from before the fields: embed_scale 1.0 and no QK-norm (what those runs trained with)
    old = {k: v for k, v in saved.items() if k not in ("qk_norm", "embed_scale")}
    assert arch_differences(old, cfg) == [("qk_norm", False, True), ("embed_scale", 1.0, "sqrt_d")]
    assert arch_differences(old, ModelConfig(hidden_size=64, num_heads=4, qk_norm=False, embed_scale=1.0)) == []
    # a field without a legacy value that the saved config lacks is not compared
    assert arch_differences({"arch": "looped"}, cfg) == [("qk_norm", False, True), ("embed_scale", 1.0, "sqrt_d")]
    # the multiplier counts, not its spelling; fields the architecture ignores are not compared
    assert arch_differences({**saved, "embed_scale": 8.0}, cfg) == []  # sqrt_d at d=64
    untied = ModelConfig(hidden_size=64, num_heads=4, arch="untied", num_layers=6)
    assert arch_differences({**saved, "arch": "untied", "num_layers": 6, "n_core": 9}, untied) == []
    assert arch_differences({**saved, "n_core": 2, "num_layers": 12}, cfg) == []  # num_layers: untied only
    assert arch_differences({**saved, "exit_norm": False}, cfg) == []  # only huginn_linear has one
    # RoPE's base and the norms' epsilon change what the weights compute: a resume took them silently
    assert arch_differences({**saved, "rope_base": 100.0, "norm_eps": 0.5}, cfg) == [
        ("rope_base", 100.0, 10000.0), ("norm_eps", 0.5, 1e-5)]
    assert arch_differences({**saved, "rope_base": 100.0, "norm_eps": 0.5}, cfg, resume=False) == []  # init_weights
    # training-only fields (window, recompute, precision) may change on resume
    assert arch_differences({**saved, "bptt_window": 2, "recompute": True, "bf16": True}, cfg) == []


def test_arch_differences_compare_the_resolved_widths():
    """A GQA checkpoint resumed without its model.num_query_groups was refused by the tensors' shape
    check alone, after an advice line that did not name the field (so following it failed again)."""
    cfg = ModelConfig(hidden_size=64, num_heads=4)
    saved = {k: getattr(cfg, k) for k in ModelConfig.ARCH_FIELDS} | {"num_query_groups": None, "ffn_hidden_size": None}
    assert arch_differences(saved, cfg) == []
    assert arch_differences({**saved, "num_query_groups": 4, "ffn_hidden_size": 192}, cfg) == []  # None = these
    assert arch_differences({**saved, "num_query_groups": 2}, cfg) == [("num_query_groups", 2, 4)]
    assert arch_differences(saved, ModelConfig(hidden_size=64, num_heads=4, num_query_groups=1)) == [
        ("num_query_groups", 4, 1)]
    assert arch_differences({**saved, "ffn_hidden_size": 256}, cfg) == [("ffn_hidden_size", 256, 192)]


def test_an_odd_head_size_is_refused_naming_the_field():
    """hidden_size 132 over 4 heads (head size 33) passed every check and crashed in megatron's rotary
    embedding at the first step (and `megaloop plan --preflight` said ok)."""
    import pytest

    from megaloop.config_utils import ConfigError

    with pytest.raises(ConfigError, match=r"model.hidden_size: the head size hidden_size/num_heads = 132/4 = 33 "
                                          r"must be even"):
        ModelConfig(hidden_size=132, num_heads=4)
    ModelConfig(hidden_size=136, num_heads=4)  # 34: fine


def test_a_ffn_width_that_is_not_positive_is_refused():
    """-64 crashed building the model (negative tensor dimension); 0 ran at the default width while the
    run recorded 0."""
    import pytest

    from megaloop.config_utils import ConfigError

    for bad in (-64, 0):
        with pytest.raises(ConfigError, match=rf"model.ffn_hidden_size: must be > 0, or null for the SwiGLU width, got {bad}"):
            ModelConfig(hidden_size=64, num_heads=4, ffn_hidden_size=bad)
    assert ModelConfig(hidden_size=64, num_heads=4, ffn_hidden_size=None).ffn_size == 192
