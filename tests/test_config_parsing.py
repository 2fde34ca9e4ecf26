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


@pytest.mark.parametrize("override", ["train.max_steps=!!int", "train.max_steps=!!float abc", "logging.name=!!int",
                                      "model.qk_norm=!!bool x", "logging.name=!!timestamp x"])
def test_yaml_tags_with_values_they_cannot_take_are_one_line(override):
    """PyYAML raises IndexError/ValueError/KeyError/AttributeError there, not YAMLError: a traceback, exit 1."""
    with pytest.raises(ConfigError) as err:
        load_config("tiny", [override])
    assert _one_line(err).startswith(f"override {override.split('=')[0]}: ")


def test_yaml_tag_in_a_config_file_is_one_line_naming_it(tmp_path):
    f = tmp_path / "t.yaml"
    f.write_text("train:\n  max_steps: !!float abc\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(f))
    assert _one_line(err).startswith(f"config file {f}: not valid YAML: a tagged value cannot be read")


def test_text_fields_keep_their_text_in_files_and_section_mappings(tmp_path):
    """YAML 1.1 types ``0123`` (octal 83), ``yes`` (True) and ``2024_01`` (202401); a text field
    recorded that reading in files and section mappings, while a ``key=value`` override kept the text."""
    f = tmp_path / "name.yaml"
    f.write_text(f"base: {resolve_config_path('tiny')}\nlogging:\n  name: 0123\ndata:\n  path: 2024_01\n")
    cfg = load_config(str(f))
    assert (cfg.logging.name, cfg.data.path) == ("0123", "2024_01")
    assert load_config("tiny", ["logging={name: 0123}"]).logging.name == "0123"
    assert load_config("tiny", ["logging={name: yes}", "data={path: 0123}"]).data.path == "0123"
    assert load_config("tiny", ["logging={name: yes}"]).logging.name == "yes"
    # numbers, booleans and null are read as before
    g = tmp_path / "typed.yaml"
    g.write_text(f"base: {resolve_config_path('tiny')}\ntrain:\n  max_steps: 0x10\nmodel:\n  qk_norm: no\n"
                 "logging:\n  name: ~\n")
    cfg = load_config(str(g))
    assert (cfg.train.max_steps, cfg.model.qk_norm, cfg.logging.name) == (16, False, None)


def test_an_earlier_releases_saved_config_trains_its_model(tmp_path, capsys):
    """A run's config.yaml from before a model field existed re-ran under today's default (QK-norm,
    √d embedding scale): another model than the run trained, while eval read the file as the run had."""
    from megaloop.config import load_saved_config

    run = tmp_path / "run.yaml"
    load_config("tiny").dump(run)
    old = tmp_path / "old.yaml"
    old.write_text("".join(line for line in run.read_text().splitlines(keepends=True)
                           if not line.lstrip().startswith(("qk_norm:", "embed_scale:"))))
    cfg = load_config(str(old))
    assert (cfg.model.qk_norm, cfg.model.embed_scale) == (False, 1.0)
    assert cfg.model == load_saved_config(old).model
    note = capsys.readouterr().err
    assert note.startswith(f"note: {old} is a run's config.yaml from an earlier release (no ")
    assert "model.qk_norm=false" in note and "model.embed_scale=1.0" in note
    assert load_config(str(old), ["model.qk_norm=true"]).model.qk_norm is True  # an override still wins
    capsys.readouterr()
    # today's saved config, a preset and a hand-written partial file keep today's defaults, silently
    assert load_config(str(run)).model == load_config("tiny").model
    part = tmp_path / "part.yaml"
    part.write_text(f"base: {resolve_config_path('tiny')}\nmodel:\n  hidden_size: 96\n")
    assert load_config(str(part)).model.qk_norm is True
    assert capsys.readouterr().err == ""


def test_a_misspelled_key_gets_a_suggestion():
    with pytest.raises(ConfigError) as err:
        load_config("tiny", ["train.max_step=3"])
    assert _one_line(err).endswith("; did you mean train.max_steps?")
    with pytest.raises(ConfigError) as err:
        load_config("tiny", ["trian.max_steps=3"])
    assert _one_line(err).endswith("; did you mean train?")
    with pytest.raises(ConfigError) as err:  # nothing close: no guess
        load_config("tiny", ["train.zzz=3"])
    assert "did you mean" not in _one_line(err)
