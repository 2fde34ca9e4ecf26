"""What ``megaloop rl`` records of its inputs and checks on ``--resume`` (the tokenizer and the task
file, each by content), task records validated before the model loads, one tokenizer per ``--out``
after ``--overwrite``, the RoPE warning for long prompts and a dangling-link ``--out``."""

from __future__ import annotations

import json

import pytest

from megaloop.post.distill.cli import main as distill_main
from megaloop.post.rl.cli import main as rl_main
from tests.conftest import bpe_tokenizer
from tests.post.cli_helpers import fake_hf, one_error_line


def _rl(model, out, steps, *extra):
    return rl_main(["--model", str(model), "--out", str(out), "--steps", str(steps), "--group-size", "2",
                    "--prompts", "1", "--max-new-tokens", "2", "--depth", "2", "--neumann-b", "2", "--device", "cpu",
                    "--save-every", "1", *extra])


def _no_load(monkeypatch) -> None:
    monkeypatch.setattr("megaloop.hf.load.load_model", lambda *a, **k: pytest.fail("the model was loaded"))


def test_resume_refuses_another_tokenizer_before_loading(tiny_teacher, tmp_path, capsys, monkeypatch):
    _, hf_dir = tiny_teacher
    out = tmp_path / "rl"
    assert _rl(hf_dir, out, 1) == 0  # the model's own tokenizer: bytes
    summary = json.loads((out / "megaloop_rl.json").read_text())
    assert summary["source"]["tokenizer"] == summary["tokenizer"] == summary["tokenizer_sha256"] == "bytes", summary
    bpe = bpe_tokenizer(tmp_path / "tok")
    capsys.readouterr()
    with monkeypatch.context() as m:
        _no_load(m)
        assert _rl(hf_dir, out, 2, "--resume", "--tokenizer", str(bpe)) == 2
    line = one_error_line(capsys)
    assert f"--tokenizer 'bytes' → '{bpe.resolve()}' (sha256 " in line, line
    assert _rl(hf_dir, out, 2, "--resume", "--tokenizer", "bytes") == 0  # the same tokenizer, named


def test_task_file_is_identified_by_content(tiny_teacher, tmp_path, capsys, monkeypatch):
    _, hf_dir = tiny_teacher
    out = tmp_path / "rl"
    data = tmp_path / "a" / "task.jsonl"
    data.parent.mkdir()
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": i + 1}) + "\n" for i in range(5)))
    monkeypatch.chdir(data.parent)
    assert _rl(hf_dir, out, 1, "--task", "exact:task.jsonl") == 0
    summary = json.loads((out / "megaloop_rl.json").read_text())
    assert summary["task"] == f"exact:{data.resolve()}" and len(summary["task_sha256"]) == 64, summary
    assert _rl(hf_dir, out, 2, "--resume", "--task", f"exact:{data}") == 0  # the same file by its absolute path
    capsys.readouterr()
    with monkeypatch.context() as m:
        _no_load(m)
        # the same relative spec from another folder, where task.jsonl holds other records
        other = tmp_path / "b" / "task.jsonl"
        other.parent.mkdir()
        other.write_text(json.dumps({"prompt": "9+9=", "answer": "18"}) + "\n")
        m.chdir(other.parent)
        assert _rl(hf_dir, out, 3, "--resume", "--task", "exact:task.jsonl") == 2
        line = one_error_line(capsys)
        assert f"--task 'exact:{data.resolve()}' (sha256 " in line and f"→ 'exact:{other.resolve()}' (sha256" in line
        # the same file, edited
        m.chdir(data.parent)
        data.write_text(data.read_text() + json.dumps({"prompt": "7+1=", "answer": "8"}) + "\n")
        assert _rl(hf_dir, out, 3, "--resume", "--task", "exact:task.jsonl") == 2
        assert "--task" in one_error_line(capsys)
        # the same content as another kind of task
        data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": i + 1}) + "\n" for i in range(5)))
        assert _rl(hf_dir, out, 3, "--resume", "--task", "gsm8k:task.jsonl") == 2
        assert "--task 'exact:" in one_error_line(capsys)
    # a checkpoint recorded before the fingerprints (the task as typed, no tokenizer) still resumes
    side = out / "checkpoints" / "step000002" / "rl_run.json"
    rec = json.loads(side.read_text())
    rec["meta"] = {k: v for k, v in rec["meta"].items() if not k.startswith("tokenizer") and k != "task_sha256"}
    rec["meta"]["task"] = "exact:task.jsonl"
    side.write_text(json.dumps(rec))
    assert _rl(hf_dir, out, 3, "--resume", "--task", "exact:task.jsonl") == 0


def test_resume_changes_compares_fingerprints_not_paths():
    from megaloop.post.rl.grpo import resume_changes

    old = {"task": "exact:/a/t.jsonl", "task_sha256": "1" * 64, "tokenizer": "/a/tokenizer.json",
           "tokenizer_sha256": "2" * 64}
    moved = {"task": "exact:/b/t.jsonl", "task_sha256": "1" * 64, "tokenizer": "/b/tokenizer.json",
             "tokenizer_sha256": "2" * 64}
    assert resume_changes(old, moved) == []
    assert resume_changes(old, {**moved, "tokenizer": "bytes", "tokenizer_sha256": "bytes"}) == \
        ["--tokenizer '/a/tokenizer.json' (sha256 222222222222) → 'bytes'"]
    assert resume_changes({"task": "arithmetic", "task_sha256": None}, {"task": "arithmetic", "task_sha256": None}) == []


BAD_RECORDS = [({"prompt": "", "answer": "1"}, "'prompt' must be a non-empty string"),
               ({"prompt": "  ", "answer": "1"}, "'prompt' must be a non-empty string"),
               ({"prompt": None, "answer": "1"}, "'prompt' must be a non-empty string, got null"),
               ({"prompt": ["a"], "answer": "1"}, "'prompt' must be a non-empty string, got [\"a\"]"),
               ({"prompt": "1+1=", "answer": {"x": 1}}, "'answer' must be a string or a number"),
               ({"prompt": "1+1=", "answer": None}, "'answer' must be a string or a number, got null"),
               ({"prompt": "1+1=", "answer": True}, "'answer' must be a string or a number, got true")]


@pytest.mark.parametrize("kind", ["exact", "gsm8k"])
@pytest.mark.parametrize("record,msg", BAD_RECORDS)
def test_bad_task_record_exits_2_naming_file_line_before_loading(tmp_path, capsys, kind, record, msg):
    model = fake_hf(tmp_path / "m")  # not loadable: reaching the load would fail differently
    data = tmp_path / "t.jsonl"
    data.write_text(json.dumps({"prompt": "2+2=", "answer": 4}) + "\n" + json.dumps(record) + "\n")
    out = tmp_path / "out"
    assert _rl(model, out, 1, "--task", f"{kind}:{data}") == 2
    line = one_error_line(capsys)
    assert f"{data}:2: " in line and msg in line, line
    assert not out.exists()


def test_number_answers_are_accepted(tmp_path):
    from megaloop.post.rl.tasks import make_task

    f = tmp_path / "t.jsonl"
    f.write_text('{"prompt": "1+1=", "answer": 2}\n{"prompt": "half", "answer": 0.5}\n')
    assert [ex.answer for ex in make_task(f"exact:{f}").examples] == ["2", "0.5"]
    assert [ex.answer for ex in make_task(f"gsm8k:{f}").examples] == ["2", "0.5"]


def test_overwrite_leaves_one_tokenizer(tmp_path):
    from megaloop.data.tokenizer import load_tokenizer
    from megaloop.hf.modeling_megaloop import MegaloopForCausalLM
    from megaloop.post.rl.io import load_tokenizer as rl_tokenizer
    from megaloop.post.rl.io import save_hf
    from megaloop.post.rl.tasks import ByteTokenizer
    from tests.post.rl.helpers import tiny_config

    src = bpe_tokenizer(tmp_path / "tok")
    (src.parent / "tokenizer_config.json").write_text("{}")
    model = MegaloopForCausalLM(tiny_config())
    out = tmp_path / "out"
    save_hf(model, out, load_tokenizer(src), extra={"run": 1})
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    (out / "notes.txt").write_text("mine")
    save_hf(model, out, ByteTokenizer(), extra={"run": 2})  # rl --overwrite --tokenizer bytes
    names = {p.name for p in out.iterdir()}
    assert not names & {"tokenizer.json", "tokenizer_config.json"} and "notes.txt" in names, names
    assert isinstance(rl_tokenizer(None, fallback_dir=out), ByteTokenizer)
    save_hf(model, out, load_tokenizer(src), extra={"run": 3})  # and back
    assert not (out / "megaloop_tokenizer.json").exists() and (out / "tokenizer.json").is_file()
    # a folder no RL save wrote: its files stay
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_text("{}")
    save_hf(model, bare, ByteTokenizer(), extra={"run": 4})
    assert (bare / "tokenizer.json").read_text() == "{}"


def test_a_bare_tokenizer_json_is_saved_so_autotokenizer_loads_it(tmp_path):
    """`rl --model <megaloop checkpoint>`: the run's tokenizer.json has no tokenizer_config.json beside
    it, and the HF folder out held only tokenizer.json, which AutoTokenizer refused ("Unrecognized
    configuration class MegaloopConfig"). It is wrapped as `megaloop convert` wraps it."""
    from transformers import AutoTokenizer

    from megaloop.data.tokenizer import load_tokenizer
    from megaloop.hf.modeling_megaloop import MegaloopForCausalLM
    from megaloop.post.rl.io import save_hf
    from tests.post.rl.helpers import tiny_config

    src = bpe_tokenizer(tmp_path / "tok")
    assert not (src.parent / "tokenizer_config.json").exists()
    tok = load_tokenizer(src)
    out = save_hf(MegaloopForCausalLM(tiny_config()), tmp_path / "out", tok, extra={"run": 1})
    assert (out / "tokenizer_config.json").is_file()
    hf = AutoTokenizer.from_pretrained(str(out))
    assert hf.padding_side == "left" and hf("a b c")["input_ids"] == tok.encode("a b c")
    assert json.loads((out / "megaloop_rl.json").read_text())["tokenizer_files"] == [
        "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]


def test_long_prompts_warn_rope_extrapolation_once(capsys):
    from types import SimpleNamespace

    from megaloop.post.rl.cli import warn_prompt_lengths
    from megaloop.post.rl.tasks import ArithmeticTask, ByteTokenizer, Example

    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=64))
    task = SimpleNamespace(examples=[Example("x" * 60, "1"), Example("short", "1")])
    warn_prompt_lengths(model, ByteTokenizer(), task, "exact:t.jsonl", 8)
    err = capsys.readouterr().err
    assert err == ("warning: prompts of up to 60 tokens plus completions of --max-new-tokens 8 reach 68 positions, "
                   "past the training seq_len 64: RoPE positions 64..67 were never trained and are extrapolated\n"), err
    warn_prompt_lengths(model, ByteTokenizer(), ArithmeticTask(), "arithmetic", 8)  # "a+b=": 4 + 8 positions
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("which", ["rl", "distill"])
def test_dangling_link_out_is_named(tmp_path, capsys, which):
    model = fake_hf(tmp_path / "m")
    out = tmp_path / "out"
    out.symlink_to(tmp_path / "gone")
    if which == "rl":
        rc = _rl(model, out, 1)
    else:
        rc = distill_main(["--teacher", str(model), "--out", str(out), "--device", "cpu"])
    line = one_error_line(capsys)
    assert rc == 2 and f"{out} is a link to {tmp_path / 'gone'}, which does not exist" in line, line
    assert "is a file" not in line and out.is_symlink() and not (tmp_path / "gone").exists()
