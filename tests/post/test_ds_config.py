"""DeepSpeed config loading: shipped configs, filled batch keys, and one-line errors naming the field."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megaloop.config_utils import ConfigError
from megaloop.post.ds_config import load_ds_config, shipped_config
from megaloop.post.engine import PlainEngine, init_post_distributed
from tests.conftest import ROOT, clean_env


def test_shipped_configs_fill_batch_keys():
    for stage in (1, 2, 3):
        assert shipped_config(f"zero{stage}").is_file()
        cfg = load_ds_config(f"zero{stage}", global_batch=16, world=4, clip_grad=1.0)
        assert cfg["zero_optimization"]["stage"] == stage
        assert (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) \
            == (16, 4, 1)
        assert cfg["gradient_clipping"] == 1.0 and cfg["zero_allow_untested_optimizer"]


@pytest.mark.parametrize("body,field", [
    ({"train_batch_size": 32}, "train_batch_size"),
    ({"train_micro_batch_size_per_gpu": 3}, "train_micro_batch_size_per_gpu"),
    ({"gradient_accumulation_steps": 2}, "gradient_accumulation_steps"),
    ({"gradient_clipping": 0.5}, "gradient_clipping"),
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage"),
    ({"zero_optimization": {"stage": "2"}}, "zero_optimization.stage"),
    ({"optimizer": {"type": "Adam"}}, "optimizer"),
])
def test_contradictions_name_the_field(tmp_path, body, field):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(body))
    with pytest.raises(ConfigError, match=rf"ds.json: {field}:"):
        load_ds_config(path, global_batch=16, world=2, clip_grad=1.0)


def test_agreeing_values_and_bad_files(tmp_path):
    path = tmp_path / "ok.json"
    path.write_text(json.dumps({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 8,
                                "zero_optimization": {"stage": 2, "overlap_comm": False}}))
    assert load_ds_config(path, global_batch=16, world=2, clip_grad=1.0)["zero_optimization"]["overlap_comm"] is False
    with pytest.raises(ConfigError, match="zero_optimization.stage: 3 is not supported"):
        load_ds_config("zero3", global_batch=8, world=2, clip_grad=1.0, stages=(0, 1, 2))
    with pytest.raises(ConfigError, match="not divisible"):
        load_ds_config("zero2", global_batch=3, world=2, clip_grad=1.0)
    with pytest.raises(ConfigError, match="no such file"):
        load_ds_config(tmp_path / "missing.json", global_batch=8, world=2, clip_grad=1.0)
    bad = tmp_path / "bad.json"
    bad.write_text("{\n  'stage': 2\n}")
    with pytest.raises(ConfigError, match=r"bad.json: not valid JSON \(line 2"):
        load_ds_config(bad, global_batch=8, world=2, clip_grad=1.0)


def test_several_processes_need_deepspeed(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="--deepspeed: required when launched on 2 processes"):
        init_post_distributed("cpu", None)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert init_post_distributed("cpu", None)[0].world == 1


def test_plain_engine_checkpoint_round_trip(tmp_path):
    import torch

    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    eng = PlainEngine(net, lr=0.1, clip_grad=1.0)
    net(torch.randn(4, 3)).pow(2).sum().backward()
    assert eng.step() > 0
    (tmp_path / "step000000").mkdir()  # a save killed mid-write left its temp file (it was never removed)
    (tmp_path / "step000000" / ".plain.pt.abc123.tmp").write_bytes(b"partial")
    eng.save(tmp_path, "step000001", {"step": 1})
    assert not (tmp_path / "step000000" / ".plain.pt.abc123.tmp").exists()
    (tmp_path / "step000000").rmdir()
    net2 = torch.nn.Linear(3, 2)
    eng2 = PlainEngine(net2, lr=0.1)
    assert eng2.load(tmp_path) == {"step": 1}
    assert torch.equal(net2.weight, net.weight)
    assert eng2.opt.state_dict()["state"][0]["exp_avg"].equal(eng.opt.state_dict()["state"][0]["exp_avg"])
    assert PlainEngine(net, lr=0.1).load(tmp_path / "none") is None
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["latest", "plain.pt", "step000001"]  # no temp files
    # 'latest' naming a folder that was deleted: named as such, not as a checkpoint of another kind
    (tmp_path / "latest").write_text("step000007")
    with pytest.raises(ConfigError, match=r"latest names checkpoint 'step000007', but .*step000007 does not exist"):
        PlainEngine(net2, lr=0.1).load(tmp_path)


def test_plain_engine_load_of_another_shape_is_one_line(tmp_path):
    """Weights of another shape: one ConfigError line naming the first mismatch (both commands load
    through the engine), not load_state_dict's error of one line per tensor."""
    import torch

    from megaloop.post.engine import CheckpointMismatch

    PlainEngine(torch.nn.Linear(3, 2), lr=0.1).save(tmp_path, "step000001", {"step": 1})
    with pytest.raises(CheckpointMismatch) as err:
        PlainEngine(torch.nn.Linear(4, 2), lr=0.1).load(tmp_path)
    msg = str(err.value)
    assert isinstance(err.value, ConfigError) and "\n" not in msg, msg
    assert msg.startswith(f"--resume: the checkpoint in {tmp_path} does not fit the model being trained"), msg
    assert "size mismatch for weight" in err.value.detail and not err.value.detail.endswith("."), err.value.detail


@pytest.mark.parametrize("cmd", [
    ["rl", "--model", "M", "--out", "O", "--deepspeed", "BADCFG", "--prompts", "2", "--group-size", "4"],
    ["distill-prefill", "--teacher", "M", "--out", "O", "--deepspeed", "BADCFG", "--batch-size", "8"],
])
def test_cli_bad_deepspeed_config_exits_2(tmp_path, cmd):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_batch_size": 5, "zero_optimization": {"stage": 1}}))
    argv = [str(cfg) if a == "BADCFG" else a for a in cmd]
    proc = subprocess.run([sys.executable, "-m", "megaloop.cli", *argv], cwd=ROOT, capture_output=True, text=True,
                          env={**clean_env(), "PYTHONWARNINGS": "ignore"}, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [l for l in proc.stderr.splitlines() if "error" in l]
    assert len(lines) == 1 and "train_batch_size: 5 contradicts the command line" in lines[0], proc.stderr


def _refused_in_one_line(tmp_path, body: dict, words: str):
    """``body`` (on top of ZeRO-2) refused by load_ds_config in one line naming the file and ``words``;
    returns the config's path."""
    pytest.importorskip("deepspeed")
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, **body}))
    with pytest.raises(ConfigError) as err:
        load_ds_config(path, global_batch=8, world=2, clip_grad=1.0)
    assert str(err.value).startswith(f"{path}: ") and words in str(err.value) and "\n" not in str(err.value), err.value
    return path


@pytest.mark.parametrize("body,words", [
    ({"wall_clock_breakdown": "yes"}, "wall_clock_breakdown: must be true or false (a JSON boolean), got 'yes'"),
    ({"memory_breakdown": 2}, "memory_breakdown: must be true or false (a JSON boolean), got 2"),
    ({"steps_per_print": "10"}, "steps_per_print: must be an integer, got '10'"),
    ({"prescale_gradients": "false"}, "prescale_gradients: must be true or false"),
    ({"tensorboard": "yes"}, "tensorboard: must be an object, got 'yes'"),
    ({"activation_checkpointing": "x"}, "activation_checkpointing: must be an object, got 'x'"),
    ({"flops_profiler": {"enabled": "maybe"}}, "flops_profiler: "),
])
def test_wrongly_typed_top_level_values_name_the_key(tmp_path, body, words):
    """A wrongly typed top-level value was DeepSpeed's TypeError traceback from deepspeed.initialize, after
    the model loaded (or a failure later in training); now one line naming the key, from the file alone."""
    path = _refused_in_one_line(tmp_path, body, words)
    # the same keys with the right types pass
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}, "wall_clock_breakdown": False,
                                "memory_breakdown": False, "steps_per_print": 5, "prescale_gradients": False,
                                "tensorboard": {"enabled": False}, "flops_profiler": {"enabled": False},
                                "gradient_clipping": "auto", "communication_data_type": "fp32"}))
    cfg = load_ds_config(path, global_batch=8, world=2, clip_grad=1.0)
    assert cfg["steps_per_print"] == 5 and cfg["gradient_clipping"] == 1.0


def test_a_directory_is_named_as_one(tmp_path):
    """--deepspeed DIR and distill-prefill --data DIR said "no such file"."""
    with pytest.raises(ConfigError, match=rf"--deepspeed {tmp_path}: is a directory"):
        load_ds_config(tmp_path, global_batch=8, world=2, clip_grad=1.0)
    from megaloop.post.distill.cli import _check_data

    with pytest.raises(ConfigError, match=rf"--data {tmp_path}: is a directory, not a file"):
        _check_data(str(tmp_path))
    with pytest.raises(ConfigError, match="no such file"):
        _check_data(str(tmp_path / "missing.txt"))


def test_cli_wrongly_typed_deepspeed_value_exits_2_before_loading(tmp_path, capsys, monkeypatch):
    """Refused before the teacher loads, and no --out folder is left behind."""
    pytest.importorskip("deepspeed")
    from megaloop.post.distill.cli import main

    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 2}, "wall_clock_breakdown": "yes"}))
    monkeypatch.setattr("megaloop.hf.load.load_model", lambda *a, **k: pytest.fail("teacher loaded"))
    out = tmp_path / "o"
    assert main(["--teacher", str(tmp_path / "missing"), "--out", str(out), "--deepspeed", str(cfg),
                 "--batch-size", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ds.json: wall_clock_breakdown: must be true or false" in err[0], err
    assert not out.exists()


def test_values_deepspeed_takes_are_not_refused(tmp_path):
    """1e9 for an integer key and 0/1 for a flag: DeepSpeed reads them (the first type check refused both)."""
    import json

    from megaloop.post.ds_config import load_ds_config

    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"zero_optimization": {"stage": 2}, "steps_per_print": 1e9, "wall_clock_breakdown": 0}))
    cfg = load_ds_config(str(p), global_batch=4, world=1, clip_grad=1.0)
    assert cfg["steps_per_print"] == 1e9 and cfg["wall_clock_breakdown"] == 0


@pytest.mark.parametrize("body,words", [
    ({"torch_autocast": {"enabled": True, "dtype": "torch.bfloat16"}}, "torch_autocast: mixed precision is not supported"),
    ({"communication_data_type": "fp16"}, "communication_data_type: 'fp16' would change the numerics"),
    ({"data_types": {"grad_accum_dtype": "bf16"}}, "data_types.grad_accum_dtype: 'bf16' would change the numerics"),
    ({"gradient_allreduce_op": "sum"}, "gradient_allreduce_op: 'sum' would change the numerics"),
    ({"prescale_gradients": True}, "prescale_gradients: True would change the numerics"),
    ({"gradient_predivide_factor": 2.0}, "gradient_predivide_factor: 2.0 would change the numerics"),
    ({"steps_per_print": 0}, "steps_per_print: must be >= 1 (DeepSpeed divides by it), got 0"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
     "zero_optimization.offload_optimizer: device 'cpu' is not supported"),
    ({"zero_optimization": {"stage": 2, "cpu_offload": True}}, "zero_optimization.cpu_offload: ZeRO-Offload is not"),
])
def test_settings_that_change_the_numerics_or_fail_later_are_refused(tmp_path, body, words):
    """Accepted before: autocast / fp16 communication / sum all-reduce changed the update silently (student
    max|diff| 0.02 after two steps); ZeRO-Offload and steps_per_print 0 failed after the teacher loaded."""
    path = _refused_in_one_line(tmp_path, body, words)
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_param": {"device": "none"}},
                                "torch_autocast": {"enabled": False}, "communication_data_type": None,
                                "data_types": {"grad_accum_dtype": "fp32"}, "gradient_allreduce_op": "mean",
                                "gradient_predivide_factor": 1.0, "steps_per_print": 1}))
    assert load_ds_config(path, global_batch=8, world=2, clip_grad=1.0)["steps_per_print"] == 1
