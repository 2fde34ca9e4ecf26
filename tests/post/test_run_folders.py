"""Run folders and early one-line refusals of ``megaloop rl`` / ``distill-prefill``: another tool's
folder is never overwritten or resumed (a pretraining run, the other command's run, finished or
interrupted); ``--resume`` is checked against the checkpoint's ``--model``, engine and ``--steps``
before anything loads; a damaged HF weights file, an unwritable ``--out``, a GSM8K answer that is no
number and a bad ``--data`` JSONL record are named in one line; the deepspeed launcher's
``--local_rank`` is accepted; Ctrl-C names ``--resume`` only when there is a checkpoint; a resumed
run's seconds include those before the interrupt; DeepSpeed config typos are refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from megaloop.config_utils import ConfigError
from megaloop.post.distill.cli import main as distill_main
from megaloop.post.rl.cli import main as rl_main
from tests.post.cli_helpers import fake_hf, one_error_line, replace_weights

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _no_load(monkeypatch) -> None:
    monkeypatch.setattr("megaloop.hf.load.load_model", lambda *a, **k: pytest.fail("the model was loaded"))


def _pretraining_run(root: Path) -> Path:
    run = root / "pretrain"
    step = run / "checkpoints" / "step_00000007"
    step.mkdir(parents=True)
    (run / "config.yaml").write_text("model:\n  hidden_size: 64\n")
    (run / "metrics.jsonl").write_text('{"step": 7, "loss": 3.2, "tokens": 1024}\n')
    (step / "megaloop.json").write_text('{"step": 7, "complete": true}')
    (step / "common.pt").write_bytes(b"c")
    (run / "checkpoints" / "latest").write_text("step_00000007")
    return run


def _post_run(out: Path, step: str, metrics: str, record: tuple[str, str], finished: dict[str, str | bytes]) -> Path:
    """A post-training --out as its tool leaves it: ``checkpoints/<step>/<record>`` + ``latest`` +
    ``metrics.jsonl``, and once ``finished``, its final files (name -> text or bytes)."""
    (out / "checkpoints" / step).mkdir(parents=True)
    (out / "metrics.jsonl").write_text(metrics)
    (out / "checkpoints" / "latest").write_text(step)
    (out / "checkpoints" / step / record[0]).write_text(record[1])
    for name, body in finished.items():
        if isinstance(body, bytes):
            (out / name).write_bytes(body)
        else:
            (out / name).write_text(body)
    return out


def _rl_run(root: Path, finished: bool) -> Path:
    return _post_run(root / ("rl" if finished else "rl_interrupted"), "step000001",
                     '{"step": 0, "arm": "reuse", "reward_mean": 0.5}\n',
                     ("rl_run.json", '{"step": 1, "tool": "megaloop rl"}'),
                     {"megaloop_rl.json": "{}", "config.json": '{"model_type": "megaloop"}',
                      "model.safetensors": b"w"} if finished else {})


def _student(root: Path, finished: bool) -> Path:
    return _post_run(root / ("student" if finished else "student_interrupted"), "step000002",
                     '{"step": 0, "loss": 1.0, "hidden": 0.5, "kl": 0.5}\n', ("distill_run.json", '{"step": 2, "run": {}}'),
                     {"student.json": "{}", "student.safetensors": b"s"} if finished else {})


def _others(root: Path, which: str) -> list[tuple[Path, str]]:
    """(folder, words the refusal names it by) of every other tool's folder."""
    pre = _pretraining_run(root)
    folders = [(pre, "holds a pretraining run (config.yaml, checkpoints/step_00000007/megaloop.json)"),
               (pre / "checkpoints", "holds a pretraining run (step_00000007/megaloop.json)"),
               (pre / "checkpoints" / "step_00000007", "holds a pretraining checkpoint (megaloop.json")]
    if which == "rl":
        folders += [(_student(root, True), "holds a prefill student (student.json)"),
                    (_student(root, False), "holds an interrupted prefill-student run")]
    else:
        folders += [(_rl_run(root, True), "holds an RL run (megaloop_rl.json"),
                    (_rl_run(root, False), "holds an interrupted RL run")]
    for name, marker, named in (("screen", "screen.json", "an LR screen"), ("repro", "plan.json", "a reproduce experiment")):
        (root / name).mkdir()  # the sweep commands' folders (found: an RL run or a student written beside them)
        (root / name / marker).write_text("{}")
        folders.append((root / name, f"holds {named} ({marker})"))
    return folders


@pytest.mark.parametrize("which", ["rl", "distill"])
@pytest.mark.parametrize("flag", [None, "--overwrite", "--resume"])
def test_another_tools_folder_is_refused_untouched(tmp_path, capsys, monkeypatch, which, flag):
    """``--overwrite`` used to delete a pretraining run's metrics.jsonl, write an HF model beside its
    config.yaml and repoint checkpoints/latest (and the same into a student / an RL run); ``--resume``
    on the other command's checkpoints gave a state_dict traceback after loading."""
    _no_load(monkeypatch)
    model = fake_hf(tmp_path / "m")
    for folder, named in _others(tmp_path / "others", which):
        before = _snapshot(folder)
        extra = [flag] if flag else []
        if which == "rl":
            rc = rl_main(["--model", str(model), "--out", str(folder), "--device", "cpu", *extra])
            mine = "not an RL run"
        else:
            rc = distill_main(["--teacher", str(model), "--out", str(folder), "--device", "cpu", *extra])
            mine = "not a prefill student"
        line = one_error_line(capsys)
        assert rc == 2 and f"--out {folder} {named}" in line and mine in line, line
        assert _snapshot(folder) == before


def test_own_runs_are_still_replaced_or_resumed(tmp_path):
    from megaloop.post.rl.io import check_out

    rl, st = _rl_run(tmp_path, False), _student(tmp_path, False)
    assert check_out(rl, "rl", resume=False, overwrite=True) == rl / "checkpoints"
    assert check_out(rl, "rl", resume=True, overwrite=False) == rl / "checkpoints"
    assert check_out(st, "student", resume=False, overwrite=True) == st / "checkpoints"
    with pytest.raises(ConfigError, match="already holds an RL run"):
        check_out(rl, "rl", resume=False, overwrite=False)


def _plain_checkpoint(out: Path, client: dict) -> None:
    """A checkpoint written before the sidecars: only plain.pt's client state tells whose it is."""
    d = out / "checkpoints" / "step000002"
    d.mkdir(parents=True)
    torch.save({"module": {}, "optimizer": {}, "client_state": client}, d / "plain.pt")
    (out / "checkpoints" / "latest").write_text("step000002")
    (out / "metrics.jsonl").write_text("")


def test_resume_on_the_other_commands_checkpoint_without_sidecar(tmp_path, capsys, monkeypatch):
    _no_load(monkeypatch)
    model = fake_hf(tmp_path / "m")
    st, rl = tmp_path / "st", tmp_path / "rl"
    _plain_checkpoint(st, {"step": 2, "sigma2": 1.0, "run": {"depth": 2}})
    _plain_checkpoint(rl, {"step": 2, "config": {"arm": "reuse", "steps": 2}, "meta": {"task": "arithmetic"}})
    assert rl_main(["--model", str(model), "--out", str(st), "--steps", "3", "--resume", "--device", "cpu"]) == 2
    assert "step000002 is a checkpoint of a prefill student (megaloop distill-prefill)" in one_error_line(capsys)
    assert distill_main(["--teacher", str(model), "--out", str(rl), "--steps", "3", "--resume", "--device",
                         "cpu"]) == 2
    assert "step000002 is a checkpoint of an RL run (megaloop rl)" in one_error_line(capsys)
    # a single-process checkpoint resumed under DeepSpeed: named before anything loads
    assert rl_main(["--model", str(model), "--out", str(rl), "--steps", "3", "--resume", "--deepspeed", "zero1",
                    "--prompts", "4", "--group-size", "8"]) == 2
    assert "was saved without --deepspeed" in one_error_line(capsys)


def _rl(model, out, steps, *extra):
    return rl_main(["--model", str(model), "--out", str(out), "--steps", str(steps), "--group-size", "2",
                    "--prompts", "1", "--max-new-tokens", "3", "--depth", "2", "--neumann-b", "2", "--device", "cpu",
                    "--save-every", "1", *extra])


def test_rl_resume_checks_model_and_steps_first_and_counts_earlier_seconds(tiny_teacher, tmp_path, capsys,
                                                                           monkeypatch):
    from megaloop.hf.modeling_megaloop import MegaloopForCausalLM
    from tests.post.rl.helpers import tiny_config

    _, hf_dir = tiny_teacher
    model = tmp_path / "m"
    shutil.copytree(hf_dir, model)
    out = tmp_path / "rl"
    assert _rl(model, out, 2) == 0
    capsys.readouterr()
    # another model of the same shape at another path (it used to resume silently): named by its weights
    # digest once it loads (the path alone was compared first, so a moved copy of the same model was refused)
    other = tmp_path / "other"
    shutil.copytree(hf_dir, other)
    replace_weights(other)
    assert _rl(other, out, 3, "--resume") == 2
    line = one_error_line(capsys)
    assert f"--model '{model.resolve()}' (weights sha256 " in line and f"'{other.resolve()}' (weights" in line, line
    with monkeypatch.context() as m:
        _no_load(m)
        # fewer --steps than the checkpoint's step (wrote an inconsistent megaloop_rl.json)
        assert _rl(model, out, 1, "--resume") == 2
        assert "--steps 1: below the checkpoint's step 2" in one_error_line(capsys)

    # interrupted after step 1's checkpoint (no megaloop_rl.json yet): the seconds before count
    (out / "megaloop_rl.json").unlink()
    (out / "checkpoints" / "latest").write_text("step000001")
    before = json.loads((out / "checkpoints" / "step000001" / "rl_run.json").read_text())["seconds"]
    assert before > 0
    assert _rl(model, out, 2, "--resume") == 0
    summary = json.loads((out / "megaloop_rl.json").read_text())
    last = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert summary["seconds"] >= round(before + last["rollout_s"] + last["update_s"], 2) - 0.01, summary
    assert 0 < summary["launch_seconds"]
    from megaloop.runtime.files import _umask

    mode = (out / "model.safetensors").stat().st_mode & 0o777  # was 0600 (safetensors' temp file)
    assert mode == (out / "config.json").stat().st_mode & 0o777 == 0o666 & ~_umask(), oct(mode)

    # the model at --model replaced by one of another shape: one line, not a size-mismatch traceback (named by
    # its weights digest, compared once it loads; a checkpoint without one meets the shape check)
    shutil.rmtree(model)
    MegaloopForCausalLM(tiny_config(hidden_size=32, intermediate_size=64)).save_pretrained(str(model))
    (model / "megaloop_tokenizer.json").write_text('{"spec": "bytes"}')
    capsys.readouterr()
    assert _rl(model, out, 3, "--resume") == 2
    line = one_error_line(capsys)
    assert f"--model '{model.resolve()}' (weights sha256 " in line and "→" in line, line


@pytest.mark.parametrize("which", ["rl", "distill"])
def test_damaged_hf_weights_named_in_one_line(tiny_teacher, tmp_path, capsys, which):
    _, hf_dir = tiny_teacher
    model = tmp_path / "m"
    shutil.copytree(hf_dir, model)
    weights = model / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(100_000)
    if which == "rl":
        rc = rl_main(["--model", str(model), "--out", str(tmp_path / "o"), "--device", "cpu"])
    else:
        rc = distill_main(["--teacher", str(model), "--out", str(tmp_path / "o"), "--device", "cpu"])
    line = one_error_line(capsys)
    assert rc == 2 and f"{weights}: cannot read the HF folder's weights" in line, line


def _unwritable_root(tmp_path: Path) -> Path:
    import os

    for cand in (Path("/proc"), Path("/sys")):  # not writable even by root
        if cand.is_dir():
            return cand
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        return ro
    pytest.skip("no folder this process cannot write to")


@pytest.mark.parametrize("which", ["rl", "distill"])
def test_unwritable_out_refused_before_loading(tmp_path, capsys, monkeypatch, which):
    _no_load(monkeypatch)
    model = fake_hf(tmp_path / "m")
    out = _unwritable_root(tmp_path) / "megaloop-out" / "x"
    if which == "rl":
        rc = rl_main(["--model", str(model), "--out", str(out), "--device", "cpu"])
    else:
        rc = distill_main(["--teacher", str(model), "--out", str(out), "--device", "cpu"])
    line = one_error_line(capsys)
    assert rc == 2 and f"--out {out}: not writable" in line, line


def test_deepspeed_launchers_local_rank_is_accepted():
    from megaloop.post.distill.cli import build_parser as distill_parser
    from megaloop.post.rl.cli import build_parser as rl_parser

    for argv in (["--local_rank=1"], ["--local-rank", "0"]):
        assert rl_parser().parse_args(["--model", "m", "--out", "o", *argv]).local_rank in (0, 1)
        assert distill_parser().parse_args(["--teacher", "m", "--out", "o", *argv]).local_rank in (0, 1)


def test_gsm8k_answer_without_a_number_is_refused(tmp_path, capsys):
    path = tmp_path / "gsm.jsonl"
    path.write_text(json.dumps({"question": "2+2?", "answer": "so #### 4"}) + "\n"
                    + json.dumps({"question": "How many?", "answer": "Some of them"}) + "\n")
    rc = rl_main(["--model", str(tmp_path / "unused"), "--out", str(tmp_path / "o"), "--task", f"gsm8k:{path}"])
    line = one_error_line(capsys)
    assert rc == 2 and f"{path}:2: answer 'Some of them' is not a number" in line, line


def test_exact_answer_that_could_never_match_is_refused(tmp_path, capsys):
    """ExactMatchReward compares the completion's first line: a several-line answer could never earn 1 (it was
    accepted; gsm8k's non-number answer was refused). An empty answer stays allowed (an empty first line)."""
    path = tmp_path / "ex.jsonl"
    for answer, words in (("a\nb", "answer 'a\\nb' spans several lines"), ("x\n\ny", "answer 'x\\n\\ny' spans")):
        path.write_text(json.dumps({"prompt": "x", "answer": "ok"}) + "\n"
                        + json.dumps({"prompt": "y", "answer": answer}) + "\n")
        rc = rl_main(["--model", str(tmp_path / "unused"), "--out", str(tmp_path / "o"), "--task", f"exact:{path}"])
        line = one_error_line(capsys)
        assert rc == 2 and f"{path}:2: {words}" in line, line


@pytest.mark.parametrize("record,msg", [
    ('{"text": "ok", ', ":2: not a JSON record"),
    ('{"body": "no text key"}', ":2: missing key(s) 'text'"),
    ('{"text": 5}', ':2: "text" must be a string, got int 5'),
    ('["text"]', ":2: a record must be a JSON object"),
])
def test_distill_bad_jsonl_record_named_before_the_teacher_loads(tmp_path, capsys, monkeypatch, record, msg):
    _no_load(monkeypatch)
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "a good first document"}\n' + record + "\n")
    rc = distill_main(["--teacher", str(fake_hf(tmp_path / "m")), "--out", str(tmp_path / "o"), "--data", str(data),
                       "--device", "cpu"])
    line = one_error_line(capsys)
    assert rc == 2 and f"--data {data}{msg}" in line, line


@pytest.mark.parametrize("which", ["rl", "distill"])
def test_ctrl_c_names_resume_only_with_a_checkpoint(tmp_path, capsys, monkeypatch, which):
    import megaloop.post.distill.cli as dcli
    import megaloop.post.rl.cli as rcli

    def interrupt(_args):
        raise KeyboardInterrupt

    monkeypatch.setattr(rcli if which == "rl" else dcli, "_run", interrupt)
    main = rl_main if which == "rl" else distill_main
    flag = "--model" if which == "rl" else "--teacher"
    out = tmp_path / "o"
    try:
        assert main([flag, "m", "--out", str(out)]) == 130
        line = one_error_line(capsys)
        assert "interrupted" in line and "no checkpoint was written" in line, line
        (out / "checkpoints" / "step000001").mkdir(parents=True)
        (out / "checkpoints" / "latest").write_text("step000001")
        assert main([flag, "m", "--out", str(out)]) == 130
        assert "continue from its last checkpoint" in one_error_line(capsys)
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C was not handled by the command")


def test_deepspeed_config_typo_and_shipped_stages(tmp_path):
    from megaloop.post.ds_config import load_ds_config

    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"tain_batch_size": 8, "zero_optimization": {"stage": 2}}))
    with pytest.raises(ConfigError, match=r"ds.json: tain_batch_size: not a DeepSpeed config key; did you mean "
                                          r"'train_batch_size'\?"):
        load_ds_config(p, global_batch=8, world=1, clip_grad=1.0)
    p.write_text(json.dumps({"zero_optimization": {"stage": 1}, "steps_per_print": 5, "wall_clock_breakdown": False,
                             "tensorboard": {"enabled": False}, "activation_checkpointing": {}}))
    assert load_ds_config(p, global_batch=8, world=1, clip_grad=1.0)["steps_per_print"] == 5
    with pytest.raises(ConfigError, match=r"no such file zero9 \(or a shipped config: zero1, zero2\)$"):
        load_ds_config("zero9", global_batch=8, world=1, clip_grad=1.0, stages=(0, 1, 2))
    with pytest.raises(ConfigError, match=r"shipped config: zero1, zero2, zero3\)$"):
        load_ds_config("zero9", global_batch=8, world=1, clip_grad=1.0)


def test_a_damaged_deepspeed_checkpoint_is_named_in_one_line(tiny_teacher, tmp_path, capsys):
    """rl --deepspeed --resume from a truncated ZeRO shard: a RuntimeError traceback (and, at DP=2, the
    other rank's "resumed" line) before; now one line naming the checkpoint, exit 2 (audit J)."""
    _, hf_dir = tiny_teacher
    out = tmp_path / "rl"
    assert _rl(hf_dir, out, 2, "--deepspeed", "zero2") == 0
    shard = next((out / "checkpoints" / "step000002").glob("*optim_states.pt"))
    shard.write_bytes(shard.read_bytes()[:1000])
    capsys.readouterr()
    assert _rl(hf_dir, out, 3, "--deepspeed", "zero2", "--resume") == 2
    line = one_error_line(capsys)
    assert "step000002 cannot be loaded, a file of it is damaged or missing" in line, line
