"""Distillation experiments: random student init, loss-term switches, and student prefill through the
inference engine (the path of --student DIR in megaloop eval / generate)."""

from __future__ import annotations

import pytest
import torch

from megaloop.config_utils import ConfigError
from megaloop.post.distill.prefill_student import (DistillConfig, PrefillStudent, distill_loss, save_student,
                                              student_prefill)
from megaloop.post.distill.student_lm import StudentPrefillLM, attach_student, with_student
from tests.post.rl.helpers import tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")


def _teacher():
    from megaloop.hf.modeling_megaloop import MegaloopForCausalLM

    torch.manual_seed(0)
    return MegaloopForCausalLM(tiny_config()).eval()


def test_random_init_differs_from_teacher_copy_and_is_seeded():
    teacher = _teacher()
    copy_ = PrefillStudent.from_teacher(teacher)
    rand_a = PrefillStudent.from_teacher(teacher, init="random", seed=1)
    rand_b = PrefillStudent.from_teacher(teacher, init="random", seed=1)
    sd_t, sd_a, sd_b = copy_.state_dict(), rand_a.state_dict(), rand_b.state_dict()
    weights = [k for k in sd_t if k.endswith("weight") and sd_t[k].dim() == 2]
    assert weights and all(not torch.equal(sd_t[k], sd_a[k]) for k in weights)
    assert all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a)
    std = teacher.config.initializer_range
    w = sd_a[weights[0]]
    assert abs(float(w.std()) - std) < 0.5 * std  # the teacher's own init scale
    with pytest.raises(ValueError, match="student init"):
        PrefillStudent.from_teacher(teacher, init="zeros")


def test_loss_switches():
    torch.manual_seed(0)
    z, zt = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    lh, lt = torch.randn(2, 5, 11), torch.randn(2, 5, 11)
    full, terms = distill_loss(z, zt, lh, lt, sigma2=2.0, lambda_kl=0.5)
    assert float(full) == pytest.approx(terms["hidden"] + 0.5 * terms["kl"], rel=1e-6)
    kl_only, t2 = distill_loss(z, zt, lh, lt, sigma2=2.0, lambda_kl=0.5, hidden_weight=0.0)
    assert float(kl_only) == pytest.approx(0.5 * t2["kl"], rel=1e-6) and t2["hidden"] == terms["hidden"]
    hidden_only, _ = distill_loss(z, zt, lh, lt, sigma2=2.0, lambda_kl=0.0)
    assert float(hidden_only) == pytest.approx(terms["hidden"], rel=1e-6)
    z.requires_grad_(True)
    lh.requires_grad_(True)
    g_z, g_l = torch.autograd.grad(distill_loss(z, zt, lh, lt, 2.0, 0.5, hidden_weight=0.0)[0], [z, lh],
                                   allow_unused=True)
    assert g_z is None and float(g_l.abs().sum()) > 0  # KL-only: no hidden-state gradient on z
    with pytest.raises(ValueError, match="no loss term left"):
        DistillConfig(hidden_loss=False, lambda_kl=0.0)


def test_student_prefill_through_inference_engine(tmp_path):
    from megaloop.inference.engine import InferenceEngine
    from megaloop.post.rl.tasks import ByteTokenizer

    teacher = _teacher()
    student = PrefillStudent.from_teacher(teacher)
    save_student(student, tmp_path / "st", meta={"depth": 3})
    engine = InferenceEngine(teacher, ByteTokenizer(), depth=3)
    wrapped = attach_student(engine, tmp_path / "st")
    assert isinstance(engine.model, StudentPrefillLM) and engine.config is teacher.config
    ids = torch.tensor([list(b"hello looped world")])
    state = engine.prefill(ids)
    assert wrapped.prefills == 1
    ref_logits, ref_cache = student_prefill(teacher, wrapped.student, ids)
    torch.testing.assert_close(state.logits, ref_logits[:, -1, :257].float())
    assert state.cache.get_seq_length() == ref_cache.get_seq_length() == ids.shape[1]
    # decoding after the student prefill goes to the teacher (no new student call)
    engine.decode(state, state.logits.argmax(-1))
    assert wrapped.prefills == 1 and state.cache.get_seq_length() == ids.shape[1] + 1
    out = engine.generate(["3+4="], max_new_tokens=3)
    assert wrapped.prefills == 2 and len(out.results[0].token_ids) <= 3
    # a left-padded batch: each row's last logits equal that row prefilled alone
    rows = [list(b"ab"), list(b"abcdef")]
    both = engine.prefill(rows)
    for i, r in enumerate(rows):
        torch.testing.assert_close(both.logits[i], engine.prefill([r]).logits[0], atol=1e-5, rtol=1e-4)
    with pytest.raises(ConfigError, match="already prefills"):
        attach_student(engine, tmp_path / "st")
    # the one loader attaches a student to an HF folder the same way (what --student DIR does)
    from megaloop.hf.load import load_model

    teacher.save_pretrained(tmp_path / "hf")
    loaded, source = load_model(tmp_path / "hf", student=tmp_path / "st")
    assert isinstance(loaded, StudentPrefillLM) and source["student"] == str(tmp_path / "st")
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, past_key_values=loaded.new_cache("terminal")).logits[:, -1],
                                   ref_logits[:, -1])
    with pytest.raises(ConfigError, match="no student.json"):
        load_model(tmp_path / "hf", student=tmp_path)


def test_student_folder_checks(tmp_path):
    teacher = _teacher()
    with pytest.raises(ConfigError, match="no student.json"):
        with_student(teacher, tmp_path)
    from megaloop.hf.modeling_megaloop import MegaloopForCausalLM

    other = MegaloopForCausalLM(tiny_config(hidden_size=32)).eval()
    save_student(PrefillStudent.from_teacher(other), tmp_path / "small")
    with pytest.raises(ConfigError, match="hidden_size=32"):
        with_student(teacher, tmp_path / "small")
