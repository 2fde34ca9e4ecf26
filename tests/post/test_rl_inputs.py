"""``megaloop rl`` inputs checked before anything loads or is written: an ``--out`` that is the
input model, holds another model or is a file; out-of-range numeric flags; ``--resume`` with
settings that change the training; and ``metrics.jsonl`` cut back to the resumed checkpoint."""

from __future__ import annotations

import json

import pytest

from megaloop.post.rl.cli import main as rl_main
from tests.post.cli_helpers import fake_hf, one_error_line


def _argv(model, out, *extra):
    return ["--model", str(model), "--out", str(out), "--steps", "2", "--group-size", "2", "--prompts", "1",
            "--depth", "2", "--neumann-b", "2", "--device", "cpu", *extra]


@pytest.mark.parametrize("extra", [(), ("--overwrite",)])
def test_out_equal_to_model_is_refused_untouched(tmp_path, capsys, extra):
    model = fake_hf(tmp_path / "m")
    for out in (model, tmp_path / "m" / ".", tmp_path / "x" / ".." / "m"):
        assert rl_main(_argv(model, out, *extra)) == 2
        line = one_error_line(capsys)
        assert "is --model" in line and "overwrite the input model" in line, line
    assert (model / "model.safetensors").read_bytes() == b"weights"
    assert sorted(p.name for p in model.iterdir()) == ["config.json", "model.safetensors"]


@pytest.mark.parametrize("extra", [(), ("--overwrite",)])
def test_out_holding_another_model_is_refused(tmp_path, capsys, extra):
    model = fake_hf(tmp_path / "m")
    other = fake_hf(tmp_path / "other")
    assert rl_main(_argv(model, other, *extra)) == 2
    line = one_error_line(capsys)
    assert f"--out {other} holds a model" in line and "metrics.jsonl" in line, line
    assert (other / "model.safetensors").read_bytes() == b"weights"


def test_out_that_is_or_lies_under_a_file(tmp_path, capsys):
    model = fake_hf(tmp_path / "m")
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert rl_main(_argv(model, afile)) == 2
    assert f"--out {afile} is a file" in one_error_line(capsys)
    assert rl_main(_argv(model, afile / "sub" / "deeper")) == 2
    assert f"lies under {afile}, which is a file" in one_error_line(capsys)
    assert afile.read_text() == "x"


BAD_FLAGS = [
    (("--prompts", "0"), "--prompts"), (("--prompts", "-1"), "--prompts"), (("--top-k", "-1"), "--top-k"),
    (("--temperature", "nan"), "--temperature"), (("--temperature", "inf"), "--temperature"),
    (("--temperature", "0"), "--temperature"), (("--temperature", "-1"), "--temperature"),
    (("--lr", "nan"), "--lr"), (("--lr", "0"), "--lr"), (("--lr=-1e-5",), "--lr"), (("--lr", "inf"), "--lr"),
    (("--threads", "0"), "--threads"), (("--threads", "-2"), "--threads"),
    (("--steps", "0"), "--steps"), (("--steps", "-1"), "--steps"), (("--save-every", "-1"), "--save-every"),
    (("--clip-grad", "-1"), "--clip-grad"), (("--clip-grad", "nan"), "--clip-grad"),
    (("--clip-grad", "inf"), "--clip-grad"), (("--bptt-window", "0"), "--bptt-window"),
    (("--bptt-window", "-1"), "--bptt-window"), (("--arm", "bptt", "--bptt-window", "3"), "--bptt-window"),
    (("--weight-decay", "nan"), "--weight-decay"), (("--kl-coef", "-1"), "--kl-coef"),
    (("--group-size", "1"), "--group-size"), (("--depth", "0"), "--depth"), (("--neumann-b", "0"), "--neumann-b"),
    (("--max-new-tokens", "0"), "--max-new-tokens"),
    (("--arm", "reuse", "--bptt-window", "2"), "--bptt-window: applies to --arm bptt only"),  # was ignored, recorded
]


@pytest.mark.parametrize("extra,flag", BAD_FLAGS)
def test_bad_numeric_flag_exits_2_naming_it_before_loading(tmp_path, capsys, extra, flag):
    model = fake_hf(tmp_path / "m")  # not loadable: reaching the load would fail differently
    out = tmp_path / "out"
    assert rl_main(_argv(model, out, *extra)) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"megaloop rl: error: {flag}"), line
    if flag in ("--group-size", "--depth", "--neumann-b", "--max-new-tokens"):  # were named by field only
        assert line.endswith(f"got {extra[-1]}"), line
    assert not out.exists()


def test_in_range_edges_are_accepted_by_the_config():
    from megaloop.post.rl.grpo import GRPOConfig

    GRPOConfig(depth=3, bptt_window=3, top_k=0, clip_grad=0.0, prompts_per_step=1, steps=1)
    GRPOConfig(depth=3, bptt_window=1, top_k=None, clip_grad=None)


@pytest.mark.parametrize("extra,flag", [(("--prompts", "0"), "--prompts"), (("--temperature", "nan"), "--temperature")])
def test_grad_check_bad_flags(tmp_path, capsys, extra, flag):
    model = fake_hf(tmp_path / "m")
    assert rl_main(["grad-check", "--model", str(model), "--device", "cpu", *extra]) == 2
    assert one_error_line(capsys).startswith(f"megaloop rl: error: {flag}")


def test_resume_changes_lists_training_fields_only():
    from megaloop.post.rl.grpo import GRPOConfig, config_dict, resume_changes

    old = {**config_dict(GRPOConfig(steps=2)), "task": "arithmetic"}
    assert resume_changes(old, {**config_dict(GRPOConfig(steps=50)), "task": "arithmetic"}) == []
    new = {**config_dict(GRPOConfig(steps=2, lr=1e-3, group_size=4, prompts_per_step=3, top_k=5,
                                    scale_rewards=False)), "task": "arithmetic-pm"}
    changes = resume_changes(old, new)
    assert changes == ["--group-size 8 → 4", "--prompts 4 → 3", "--top-k None → 5", "--no-scale-rewards True → False",
                       "--lr 1e-05 → 0.001", "--task 'arithmetic' → 'arithmetic-pm'"], changes
    assert resume_changes({"lr": 1e-5}, new) == ["--lr 1e-05 → 0.001"]  # keys an old checkpoint lacks: skipped


def _rl_run(model, out, steps, *extra) -> int:
    return rl_main(["--model", str(model), "--out", str(out), "--steps", str(steps), "--group-size", "2",
                    "--prompts", "1", "--max-new-tokens", "3", "--depth", "2", "--neumann-b", "2",
                    "--device", "cpu", "--save-every", "1", *extra])


def test_resume_refuses_changed_flags_and_cuts_metrics(tiny_teacher, tmp_path, capsys):
    _, hf_dir = tiny_teacher
    out = tmp_path / "rl"

    def run(steps, *extra):
        return _rl_run(hf_dir, out, steps, *extra)

    assert run(2) == 0
    metrics = out / "metrics.jsonl"
    before = metrics.read_text()
    capsys.readouterr()
    assert run(3, "--resume", "--lr", "1e-3", "--group-size", "4", "--task", "arithmetic-pm") == 2
    line = one_error_line(capsys)
    assert "--lr 1e-05 → 0.001" in line and "--group-size 2 → 4" in line and "--task 'arithmetic' → 'arithmetic-pm'" \
        in line, line
    assert metrics.read_text() == before
    # an interrupt after step 1's record but before its checkpoint: the record is dropped and redone once
    (out / "checkpoints" / "latest").write_text("step000001")
    with metrics.open("a") as f:
        f.write('{"step": 2, "torn')
    assert run(3, "--resume") == 0
    steps = [json.loads(l)["step"] for l in metrics.read_text().splitlines()]
    assert steps == [0, 1, 2], steps
    assert "dropped 2 record(s)" in capsys.readouterr().out
    # the summary covers the whole run, also when a finished run is resumed again (a resubmitted job)
    records = [json.loads(l) for l in metrics.read_text().splitlines()]
    summary = json.loads((out / "megaloop_rl.json").read_text())
    assert summary["final"] == records[-1] and summary["reward_mean_first"] == records[0]["reward_mean"]
    assert run(3, "--resume") == 0
    again = json.loads((out / "megaloop_rl.json").read_text())
    assert {k: again[k] for k in ("final", "reward_mean_first", "reward_mean_last")} == \
        {k: summary[k] for k in ("final", "reward_mean_first", "reward_mean_last")}
    assert again["seconds"] >= summary["seconds"]


def test_rope_extrapolation_is_warned(capsys):
    from types import SimpleNamespace

    from megaloop.post.rl.io import warn_rope_extrapolation

    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=128))
    assert not warn_rope_extrapolation(model, 128, "x")
    assert warn_rope_extrapolation(model, 201, "completions of --max-new-tokens 200")
    assert capsys.readouterr().err == ("warning: completions of --max-new-tokens 200 reach 201 positions, past the "
                                       "training seq_len 128: RoPE positions 128..200 were never trained and are "
                                       "extrapolated\n")


def test_resume_on_a_model_replaced_in_place_by_other_weights_is_refused(tiny_teacher, tmp_path, capsys):
    """--model is the KL reference: its files replaced by another model of the same shape were resumed
    silently (the path alone was recorded). Its weights digest is compared now."""
    import shutil

    from tests.post.cli_helpers import replace_weights

    _, hf_dir = tiny_teacher
    model, out = tmp_path / "m", tmp_path / "rl"
    shutil.copytree(hf_dir, model)
    assert _rl_run(model, out, 1) == 0
    replace_weights(model)
    capsys.readouterr()
    assert _rl_run(model, out, 2, "--resume") == 2
    line = one_error_line(capsys)
    assert f"--model {str(model.resolve())!r} (weights sha256 " in line and "→" in line, line


def test_resume_with_the_model_moved_continues_as_at_its_old_path(tiny_teacher, tmp_path):
    """--model is identified by its weights digest: the same model moved to another path resumed only
    back at the old path (the path was compared before the load), now it continues as it would there."""
    import shutil

    import torch
    from safetensors.torch import load_file

    _, hf_dir = tiny_teacher
    model, a, b = tmp_path / "m", tmp_path / "a", tmp_path / "b"
    shutil.copytree(hf_dir, model)
    assert _rl_run(model, a, 1) == 0
    shutil.copytree(a, b)
    assert _rl_run(model, a, 2, "--resume") == 0
    moved = model.rename(tmp_path / "moved")
    assert _rl_run(moved, b, 2, "--resume") == 0
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
