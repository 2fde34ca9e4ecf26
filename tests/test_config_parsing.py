"""YAML ``base:`` chains, duplicate keys and ``section.key=value`` overrides: one ConfigError line naming the
file/field, string fields kept as typed, section mappings merged."""

import re

import pytest

from megaloop.config import load_config, resolve_config_path
from megaloop.config_utils import ConfigError, apply_dotlist, load_yaml


def _one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert "\n" not in msg, msg
    return msg


def test_base_cycle_names_the_files_in_order(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("base: b.yaml\ntrain:\n  max_steps: 4\n")
    b.write_text("base: a.yaml\n")
    with pytest.raises(ConfigError) as err:
        load_yaml(a)
    assert _one_line(err) == f"config file {b}: base: cycle {a} -> {b} -> {a}"
    me = tmp_path / "me.yaml"
    me.write_text("base: me.yaml\n")
    with pytest.raises(ConfigError, match=rf"^config file {me}: base: cycle {me} -> {me}$"):
        load_config(str(me))


def test_base_that_is_not_a_file_name_or_names_no_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("base: [x.yaml]\n")
    with pytest.raises(ConfigError, match=re.escape(f"config file {bad}: base: expected a YAML file name "
                                                    "(resolved beside it), got ['x.yaml']")):
        load_config(str(bad))
    preset = tmp_path / "preset.yaml"
    preset.write_text("base: tiny\n")  # a preset name, not a file beside it
    with pytest.raises(ConfigError) as err:
        load_config(str(preset))
    assert _one_line(err) == (f"config file {preset}: base: 'tiny' is no such file (looked for {tmp_path / 'tiny'}, "
                              "beside preset.yaml; give a YAML file's name or path)")
    ok = tmp_path / "ok.yaml"
    ok.write_text(f"base: {resolve_config_path('tiny')}\ntrain:\n  max_steps: 40\n")
    assert load_config(str(ok)).train.max_steps == 40  # a path still works, chains of bases too


@pytest.mark.parametrize("text,key,line", [
    ("train:\n  max_steps: 4\n  max_steps: 8\n", "max_steps", 3),
    ("optim:\n  lr: 1.0e-3\ntrain:\n  max_steps: 4\noptim:\n  warmup_steps: 2\n", "optim", 5),
    ("train: {max_steps: 4, max_steps: 8}\n", "max_steps", 1),
])
def test_duplicate_yaml_keys_are_named_with_file_and_line(tmp_path, text, key, line):
    f = tmp_path / "dup.yaml"
    f.write_text(f"base: {resolve_config_path('tiny')}\n{text}")
    with pytest.raises(ConfigError) as err:
        load_config(str(f))
    assert re.fullmatch(rf"config file {re.escape(str(f))}: duplicate key '{key}' \(line {line + 1}, column \d+; "
                        rf"first given on line \d+\); give each key once", _one_line(err)), err.value


def test_yaml_merge_keys_and_existing_errors_still_work(tmp_path):
    f = tmp_path / "anchors.yaml"
    f.write_text("x: &d {a: 1, b: 2}\ny:\n  <<: *d\n  b: 3\n")
    assert load_yaml(f) == {"x": {"a": 1, "b": 2}, "y": {"a": 1, "b": 3}}
    # a shared anchor used through a nested merge before its own mapping is built (PyYAML rewrites
    # it in place): its merged keys are not its own duplicates
    chain = tmp_path / "chain.yaml"
    chain.write_text("x: &A {lr: 0.001}\ngroup:\n  b: &B\n    <<: *A\n    lr: 0.002\nc:\n  <<: *B\n  warmup: 3\n")
    assert load_yaml(chain)["c"] == {"lr": 0.002, "warmup": 3}
    top = tmp_path / "list.yaml"
    top.write_text("- 1\n")
    with pytest.raises(ConfigError, match=rf"^config file {top}: top level must be a mapping$"):
        load_yaml(top)


@pytest.mark.parametrize("override,name", [
    ("logging.name=3e-3", "3e-3"), ("logging.name=0123", "0123"), ("logging.name=12:30", "12:30"),
    ("logging.name=yes", "yes"), ("logging.name=#x", "#x"), ("logging.name=a #b", "a #b"),
    ("logging.name='3e-4'", "3e-4"), ('logging.name="0123"', "0123"), ("logging.name=2024-01-01", "2024-01-01"),
    ("logging.name=null", None), ("logging.name=~", None), ("logging.name=run-1", "run-1"),
])
def test_string_fields_keep_the_override_text(override, name):
    assert load_config("tiny", [override]).logging.name == name


def test_string_field_paths_and_numeric_fields():
    assert load_config("tiny", ["data.path=0755"]).data.path == "0755"
    assert load_config("tiny", ["data.path=a=b"]).data.path == "a=b"  # everything after the first '='
    cfg = load_config("tiny", ["optim.lr=1e-3", "train.max_steps=40", "model.recompute=true"])
    assert (cfg.optim.lr, cfg.train.max_steps, cfg.model.recompute) == (1e-3, 40, True)
    assert load_config("tiny", ["optim.lr='3e-4'"]).optim.lr == 3e-4
    assert load_config("tiny", ["model.recompute=false"]).model.recompute is False
    # a later section mapping replaces an earlier override's text with its own YAML value
    assert load_config("tiny", ["logging.name=0123", "logging={name: run}"]).logging.name == "run"


def test_section_mapping_override_merges_into_the_section():
    tiny = load_config("tiny")
    cfg = load_config("tiny", ["train={max_steps: 40}"])
    assert cfg.train.max_steps == 40
    assert (cfg.train.global_batch_size, cfg.train.eval_depth) == (tiny.train.global_batch_size, tiny.train.eval_depth)
    depth = load_config("tiny", ["depth={kind: fixed, depth: 3}"]).depth
    assert (depth.kind, depth.depth, depth.cap, depth.r_max) == ("fixed", 3, tiny.depth.cap, tiny.depth.r_max)
    assert load_config("tiny", ["model={}"]).model == tiny.model
    assert apply_dotlist({"a": {"b": {"c": 1, "d": 2}}}, ["a={b: {c: 5}}"]) == {"a": {"b": {"c": 5, "d": 2}}}


def test_exponent_numbers_in_yaml_files_and_section_mappings(tmp_path):
    """YAML 1.1 reads ``1e-3`` as text: ``lr: 1e-3`` in a config file and ``optim={lr: 1e-3}`` were refused
    ("expected a finite number, got '1e-3'"); number fields read it as the number, text fields keep it."""
    f = tmp_path / "run.yaml"
    f.write_text(f"base: {resolve_config_path('tiny')}\noptim:\n  lr: 1e-3\n  min_lr: 1.0E-5\n"
                 "train:\n  max_steps: 2e3\nlogging:\n  name: 1e3\n")
    cfg = load_config(str(f))
    assert (cfg.optim.lr, cfg.optim.min_lr, cfg.train.max_steps, cfg.logging.name) == (1e-3, 1e-5, 2000, "1e3")
    cfg = load_config("tiny", ["optim={lr: 1e-3}", "depth={sigma: 5e-1}"])
    assert (cfg.optim.lr, cfg.depth.sigma) == (1e-3, 0.5)
    with pytest.raises(ConfigError, match=r"^train.max_steps: expected an integer, got 2.5$"):
        load_config("tiny", ["train={max_steps: 25e-1}"])
    with pytest.raises(ConfigError, match=r"^optim.lr: expected a finite number, got '1e-3x'$"):
        load_config("tiny", ["optim={lr: 1e-3x}"])


def test_section_mapping_override_reads_renamed_fields():
    """``model={b_max: 3}`` merged the old name beside the preset's new one and was refused as given twice."""
    assert load_config("tiny", ["model={b_max: 3}"]).model.bptt_window == 3
    assert load_config("tiny", ["model.b_max=2"]).model.bptt_window == 2
    for both in ("model={b_max: 3, bptt_window: 2}", "model={bptt_window: 2, b_max: 3}"):
        with pytest.raises(ConfigError) as err:
            load_config("tiny", [both])
        assert _one_line(err) == "model.b_max: renamed to model.bptt_window; give only one of them"


@pytest.mark.parametrize("override,message", [
    ("=1", "override '=1' has no key: expected section.key=value (e.g. train.max_steps=20)"),
    (".x=1", "override '.x=1' has an empty name in key '.x': expected section.key=value"),
    ("train.=1", "override 'train.=1' has an empty name in key 'train.': expected section.key=value"),
])
def test_override_without_a_key(override, message):
    with pytest.raises(ConfigError) as err:
        load_config("tiny", [override])
    assert _one_line(err).startswith(message)
