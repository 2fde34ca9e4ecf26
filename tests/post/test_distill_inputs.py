"""``megaloop distill-prefill`` input checks: numeric flags and ``--out`` refused before the teacher
loads, ``--resume`` tied to the checkpoint's flags and σ_T², metrics.jsonl flushed and cut back on
resume, mixed-precision DeepSpeed sections refused."""

from __future__ import annotations

import json

import pytest

from megaloop.config_utils import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _main(argv):
    from megaloop.post.distill.cli import main

    return main(argv)


@pytest.mark.parametrize("flag,value", [
    ("--lr", "nan"), ("--lr", "0"), ("--lr", "inf"), ("--log-every", "0"), ("--calib-batches", "0"),
    ("--eval-batches", "0"), ("--num-layers", "0"), ("--num-layers", "-1"), ("--warmup", "-1"),
    ("--threads", "0"), ("--save-every", "-1"), ("--max-chars", "-1"), ("--clip-grad", "nan"),
])
def test_numeric_flags_refused_before_loading(tmp_path, capsys, flag, value):
    """A teacher path that does not exist: the flag's check must come first."""
    rc = _main(["--teacher", str(tmp_path / "missing"), "--out", str(tmp_path / "o"), flag, value])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and flag in err[0] and "missing" not in err[0], err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("steps,warmup", [("30", "30"), ("30", "31"), ("1", "1"), ("500", "500")])
def test_warmup_not_below_steps_refused_before_loading(tmp_path, capsys, steps, warmup):
    """As `megaloop train` refuses optim.warmup_steps >= train.max_steps (the warm-up never ended: --lr was
    never reached); one line naming both, before the teacher (missing here) is looked at."""
    rc = _main(["--teacher", str(tmp_path / "missing"), "--out", str(tmp_path / "o"), "--steps", steps,
                "--warmup", warmup])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and f"--warmup {warmup}" in err[0] and f"--steps {steps}" in err[0], err
    assert "missing" not in err[0] and not (tmp_path / "o").exists()
    # below --steps, no warm-up, or the default (shortened on a short run): on to the teacher check
    for more in (["--warmup", str(int(steps) - 1)], ["--warmup", "0"], []):
        assert _main(["--teacher", str(tmp_path / "missing"), "--out", str(tmp_path / "o"), "--steps", steps,
                      *more]) == 2
        assert "missing" in capsys.readouterr().err


def test_out_file_or_rl_run_refused(tmp_path, capsys):
    f = tmp_path / "afile"
    f.write_text("x")
    for out, want in ((f, "is a file"), (f / "sub", "is a file")):
        assert _main(["--teacher", str(tmp_path / "missing"), "--out", str(out)]) == 2
        assert want in capsys.readouterr().err
    rl = tmp_path / "rl"
    rl.mkdir()
    (rl / "megaloop_rl.json").write_text("{}")
    (rl / "metrics.jsonl").write_text("")
    for extra in ([], ["--resume"], ["--overwrite"]):
        assert _main(["--teacher", str(tmp_path / "missing"), "--out", str(rl), *extra]) == 2
        err = capsys.readouterr().err
        assert "holds an RL run (megaloop_rl.json" in err and "already holds a student" not in err, err


def test_mixed_precision_deepspeed_sections_refused(tmp_path):
    from megaloop.post.ds_config import load_ds_config

    for section in ("fp16", "bf16", "bfloat16", "amp"):
        p = tmp_path / f"{section}.json"
        p.write_text(json.dumps({"zero_optimization": {"stage": 2}, section: {"enabled": True}}))
        with pytest.raises(ConfigError, match=f": {section}: mixed precision"):
            load_ds_config(str(p), global_batch=4, world=1, clip_grad=1.0)
        p.write_text(json.dumps({"zero_optimization": {"stage": 2}, section: {"enabled": False}}))
        if section == "amp":  # the pinned DeepSpeed removed Apex AMP and rejects even a switched-off section
            # (in deepspeed.initialize, after the model loaded): now refused before, naming it
            with pytest.raises(ConfigError, match=rf"{p.name}: amp: .*removed"):
                load_ds_config(str(p), global_batch=4, world=1, clip_grad=1.0)
            continue
        load_ds_config(str(p), global_batch=4, world=1, clip_grad=1.0)  # switched off: fine


def test_a_zero_section_deepspeed_rejects_is_refused_up_front(tmp_path):
    # DeepSpeed's own check of zero_optimization, before the model loads (it was a pydantic traceback
    # from deepspeed.initialize, after loading)
    from megaloop.post.ds_config import load_ds_config

    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"zero_optimization": {"stage": 2, "bogus_key": 1}}))
    with pytest.raises(ConfigError, match=r"ds.json: zero_optimization: bogus_key: Extra inputs are not permitted"):
        load_ds_config(str(p), global_batch=4, world=1, clip_grad=1.0)
    p.write_text(json.dumps({"zero_optimization": {"stage": 2, "overlap_comm": True}}))
    assert load_ds_config(str(p), global_batch=4, world=1, clip_grad=1.0)["zero_optimization"]["overlap_comm"]


def test_metrics_flushed_before_each_checkpoint_and_cut_on_resume(tmp_path):
    from megaloop.post.runs import cut_metrics

    m = tmp_path / "metrics.jsonl"
    m.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(6)) + '{"step": 6, "lo')
    assert cut_metrics(m, 4) == 3  # steps 4, 5 and the torn line
    assert not list(tmp_path.glob("*.tmp"))
    assert [json.loads(line)["step"] for line in m.read_text().splitlines()] == [0, 1, 2, 3]


def _args(hf_dir, text, out, *extra):
    return ["--teacher", str(hf_dir), "--out", str(out), "--data", str(text), "--batch-size", "2", "--seq-len", "16",
            "--calib-batches", "1", "--eval-batches", "1", "--depth", "2", "--warmup", "1", "--log-every", "1",
            *extra]


def test_resume_checks_flags_reuses_sigma2_and_cuts_metrics(tiny_teacher, tmp_path, capsys, monkeypatch):
    import megaloop.post.distill.prefill_student as ps

    _, hf_dir = tiny_teacher
    text = tmp_path / "data.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / "stud"
    seen = []
    real_train = ps.train_student

    def spy(*a, save=None, metrics_path=None, **k):  # the metrics file holds every step before each save
        def wrapped(step):
            seen.append((step, len(metrics_path.read_text().splitlines())))
            save(step)
        return real_train(*a, save=wrapped if save else None, metrics_path=metrics_path, **k)

    monkeypatch.setattr(ps, "train_student", spy)
    assert _main(_args(hf_dir, text, out, "--steps", "4", "--save-every", "2")) == 0
    assert seen == [(2, 2), (4, 4)]
    full = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    sigma2 = json.loads((out / "student.json").read_text())["sigma2"]
    capsys.readouterr()

    # changed flags: one line naming each field old -> new, before the teacher loads
    monkeypatch.setattr("megaloop.hf.load.load_model", lambda *a, **k: pytest.fail("teacher loaded"))
    rc = _main(_args(hf_dir, text, out, "--steps", "6", "--lr", "0.002", "--num-layers", "3", "--resume"))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--lr 0.001 -> 0.002" in err[0] and "--num-layers None -> 3" in err[0], err
    assert _main(_args(hf_dir, text, out, "--steps", "3", "--resume")) == 2
    assert "--steps 3" in capsys.readouterr().err
    monkeypatch.undo()

    # resume from step 2 (as if killed after it): σ_T² from the checkpoint, metrics cut back to step 2
    (out / "checkpoints" / "latest").write_text("step000002")
    monkeypatch.setattr(ps, "calibrate_sigma2", lambda *a, **k: pytest.fail("recalibrated on resume"))
    assert _main(_args(hf_dir, text, out, "--steps", "4", "--resume")) == 0
    assert "note: --steps" not in capsys.readouterr().err  # same horizon: nothing to say
    again = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in again] == [0, 1, 2, 3]
    assert [r["loss"] for r in again] == pytest.approx([r["loss"] for r in full], rel=1e-5)
    assert json.loads((out / "student.json").read_text())["sigma2"] == sigma2
    from megaloop.runtime.files import _umask

    mode = (out / "student.safetensors").stat().st_mode & 0o777  # was 0600 (safetensors' temp file)
    assert mode == (out / "student.json").stat().st_mode & 0o777 == 0o666 & ~_umask(), oct(mode)

    # a longer horizon: the cosine schedule now spans it, and the LR jump at the resumed step is named
    from dataclasses import replace

    cfg = ps.DistillConfig(**{k: v for k, v in json.loads((out / "student.json").read_text())["config"].items()
                              if k in ps.DistillConfig.__dataclass_fields__})
    assert _main(_args(hf_dir, text, out, "--steps", "6", "--resume")) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: --steps")]
    new, old = ps.lr_at(replace(cfg, steps=6), 4), ps.lr_at(replace(cfg, steps=4), 3)
    assert new > old and notes == [f"note: --steps 4 -> 6: the learning-rate schedule (warm-up, cosine decay) now "
                                   f"spans 6 steps, so step 4 trains at lr {new:.3g} (the last step trained, 3, was "
                                   f"at {old:.3g})"], notes
    assert not list(out.glob(".*tmp"))


def _student_run(tiny_teacher, tmp_path):
    """A one-step student of a copy of the tiny teacher, checkpointed: (teacher copy, data file, --out)."""
    import shutil

    _, hf_dir = tiny_teacher
    teacher = tmp_path / "t"
    shutil.copytree(hf_dir, teacher)
    text = tmp_path / "data.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / "stud"
    assert _main(_args(teacher, text, out, "--steps", "1", "--warmup", "0", "--save-every", "1")) == 0
    return teacher, text, out


def _resume_error(teacher, text, out, capsys) -> list[str]:
    capsys.readouterr()
    assert _main(_args(teacher, text, out, "--steps", "2", "--warmup", "0", "--resume")) == 2
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def test_resume_on_a_teacher_of_another_shape_is_one_line(tiny_teacher, tmp_path, capsys):
    """The --teacher at the checkpoint's path replaced by a model of another shape: the student
    checkpoint no longer fits; one line, not load_state_dict's traceback."""
    import shutil

    from megaloop.hf.modeling_megaloop import MegaloopForCausalLM
    from tests.post.rl.helpers import tiny_config

    teacher, text, out = _student_run(tiny_teacher, tmp_path)
    shutil.rmtree(teacher)
    MegaloopForCausalLM(tiny_config(hidden_size=32, intermediate_size=64)).save_pretrained(str(teacher))
    (teacher / "megaloop_tokenizer.json").write_text('{"spec": "bytes"}')
    err = _resume_error(teacher, text, out, capsys)
    # the weights digest, compared after the teacher loads, names it first (the shape check: a checkpoint without one)
    assert len(err) == 1 and f"--teacher {teacher} holds other weights than the teacher" in err[0], err


def test_resume_on_a_teacher_replaced_in_place_by_other_weights_is_refused(tiny_teacher, tmp_path, capsys):
    """The --teacher files replaced by another model of the same shape: the resume went on silently with
    the old σ_T² against the new teacher (loss 12 -> 10710). Its weights digest is compared now."""
    from tests.post.cli_helpers import replace_weights

    teacher, text, out = _student_run(tiny_teacher, tmp_path)
    replace_weights(teacher)
    err = _resume_error(teacher, text, out, capsys)
    assert len(err) == 1 and f"--teacher {teacher} holds other weights than the teacher" in err[0], err


def test_resume_with_the_teacher_and_data_moved_continues_as_at_their_old_paths(tiny_teacher, tmp_path, capsys):
    """--teacher is identified by its weights digest and --data by its SHA-256: moved, the same files
    resumed only back at their old paths (compared by path), now the run continues as it would there;
    other text at --data is still refused."""
    import shutil

    import torch
    from safetensors.torch import load_file

    teacher, text, a = _student_run(tiny_teacher, tmp_path)
    b, c = tmp_path / "b", tmp_path / "c"
    shutil.copytree(a, b)
    shutil.copytree(a, c)
    assert _main(_args(teacher, text, a, "--steps", "2", "--warmup", "0", "--resume")) == 0
    moved, moved_text = teacher.rename(tmp_path / "moved"), text.rename(tmp_path / "moved.txt")
    assert _main(_args(moved, moved_text, b, "--steps", "2", "--warmup", "0", "--resume")) == 0
    wa, wb = load_file(a / "student.safetensors"), load_file(b / "student.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    moved_text.write_text("Other words entirely, for another run. " * 40)
    err = _resume_error(moved, moved_text, c, capsys)
    assert len(err) == 1 and "--data" in err[0] and "other flags" in err[0], err
    # a moved teacher whose folder holds another tokenizer: its SHA-256 decides (the path did before)
    from tests.conftest import bpe_tokenizer

    moved_text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    other = tmp_path / "other_tok"
    shutil.copytree(moved, other)
    bpe_tokenizer(other)
    err = _resume_error(other, moved_text, c, capsys)
    assert len(err) == 1 and "other flags: the teacher's tokenizer (sha256 " in err[0], err
