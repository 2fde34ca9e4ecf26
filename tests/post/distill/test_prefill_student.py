"""Distilled prefill (SPEC §10): student init, exact prefill plumbing, training lowers the loss,
decoding after student prefill with a terminal cache, save/load, CLI."""

from __future__ import annotations

import json

import pytest
import torch

from megaloop.post.distill.prefill_student import (DistillConfig, PrefillStudent, calibrate_sigma2, distill_loss,
                                              generate, load_student, save_student, student_prefill,
                                              token_stream, train_student, window_batches)
from megaloop.post.rl.parts import HFLoopedParts
from megaloop.post.rl.tasks import ByteTokenizer
from tests.post.rl.helpers import corpus_ids, tiny_config


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _random_teacher(injection="parcae_nonorm", **kw):
    from megaloop.hf.modeling_megaloop import MegaloopForCausalLM

    torch.manual_seed(0)
    return MegaloopForCausalLM(tiny_config(injection=injection, hidden_size=32, intermediate_size=64, **kw)).eval()


class OracleStudent(torch.nn.Module):
    """ẑ = the teacher's state after R−1 recurrences: student prefill must then equal teacher prefill at R."""

    init_state = "teacher"

    def __init__(self, teacher, depth):
        super().__init__()
        self.parts, self.depth = HFLoopedParts(teacher), depth

    def forward(self, p, h0):
        z = h0
        for _ in range(self.depth - 1):
            z = self.parts.step(z, p.e)
        return z


@pytest.mark.parametrize("injection", ["parcae_nonorm", "huginn_linear", "deq_qkv"])
def test_prefill_plumbing_is_exact(injection):
    teacher = _random_teacher(injection, num_key_value_heads=2)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    ref_cache = teacher.new_cache("terminal")
    with torch.no_grad():
        ref = teacher(ids, past_key_values=ref_cache, num_recurrences=4).logits[:, -1:]
    logits, cache = student_prefill(teacher, OracleStudent(teacher, 4), ids)
    assert torch.allclose(logits, ref, atol=1e-5, rtol=1e-5)
    assert cache.mode == "terminal" and set(cache.banks) == set(ref_cache.banks)
    for key, bank in ref_cache.banks.items():
        for a, b in zip(cache.banks[key].view(), bank.view()):
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), key
    nxt = ref.argmax(-1)  # decoding continues identically from either cache
    with torch.no_grad():
        a = teacher(nxt, past_key_values=cache, num_recurrences=3).logits
        b = teacher(nxt, past_key_values=ref_cache, num_recurrences=3).logits
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError):
        student_prefill(teacher, OracleStudent(teacher, 4), ids, cache=teacher.new_cache("per_visit"))


def test_student_starts_as_one_teacher_recurrence():
    teacher = _random_teacher("orthoinj")
    student = PrefillStudent.from_teacher(teacher)
    parts = HFLoopedParts(teacher)
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        e = parts.encode(ids)
        h0 = parts.init_state(e)
        assert torch.allclose(student(parts.pass_for(e), h0), parts.step(h0, e), atol=1e-6)
    assert PrefillStudent.from_teacher(teacher, num_layers=3).num_layers == 3


def test_loss_definition():
    z_hat, z = torch.zeros(2, 3, 4), torch.ones(2, 3, 4)
    logits = torch.randn(2, 3, 10)
    loss, terms = distill_loss(z_hat, z, logits, logits, sigma2=2.0, lambda_kl=0.5)
    assert terms["hidden"] == pytest.approx(0.5) and abs(terms["kl"]) < 1e-6 and float(loss) == pytest.approx(0.5)
    other = torch.randn(2, 3, 10)
    _, t2 = distill_loss(z, z, other, logits, sigma2=1.0, lambda_kl=1.0)
    p, q = logits.log_softmax(-1), other.log_softmax(-1)
    assert t2["kl"] == pytest.approx(float((p.exp() * (p - q)).sum(-1).mean()), rel=1e-5) and t2["hidden"] == 0


def test_student_training_lowers_loss_then_prefill_and_decode(tiny_teacher, tmp_path):
    teacher, _ = tiny_teacher
    data = corpus_ids()
    cfg = DistillConfig(depth=5, lambda_kl=1.0, steps=150, batch_size=4, seq_len=32, lr=2e-3, warmup=10,
                        calib_batches=2, log_every=1000)
    batches = window_batches(data, cfg.batch_size, cfg.seq_len, seed=0)
    calib = [next(batches) for _ in range(2)]
    sigma2 = calibrate_sigma2(teacher, calib, cfg.depth)
    assert sigma2 > 0
    student = PrefillStudent.from_teacher(teacher)
    before = [p.detach().clone() for p in teacher.parameters()]
    res = train_student(teacher, student, batches, cfg, sigma2=sigma2, log=None)
    hist = res["history"]
    first = sum(h["loss"] for h in hist[:10]) / 10
    last = sum(h["loss"] for h in hist[-10:]) / 10
    assert last < 0.7 * first, (first, last)
    assert all(torch.equal(a, p) for a, p in zip(before, teacher.parameters()))  # teacher frozen, untouched
    assert all(p.requires_grad for p in teacher.parameters())

    prompt = torch.tensor([list(b"The return value of the function ")])
    out, cache = generate(teacher, student, prompt, max_new_tokens=6, decode_recurrences=5)
    cfg_t = teacher.config
    assert out.shape == (1, prompt.shape[1] + 6)
    assert cache.mode == "terminal" and cache.visits == 1
    assert cache.num_banks() == cfg_t.n_prelude + cfg_t.n_core + cfg_t.n_coda
    assert cache.get_seq_length() == prompt.shape[1] + 5  # the last sampled token is not fed back
    assert cache.kv_bytes_per_token() == teacher.kv_bytes_per_token("terminal")

    path = save_student(student, tmp_path / "student", meta={"sigma2": sigma2, "depth": 5})
    loaded, info = load_student(path)
    assert info["sigma2"] == sigma2 and info["num_layers"] == cfg_t.n_core and info["init_state"] == "teacher"
    a, _ = student_prefill(teacher, student, prompt)
    b, _ = student_prefill(teacher, loaded, prompt)
    assert torch.equal(a, b)


def test_cli(tiny_teacher, tmp_path, capsys):
    from megaloop.post.distill.cli import main

    _, hf_dir = tiny_teacher
    text = tmp_path / "data.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / "stud"
    rc = main(["--teacher", str(hf_dir), "--out", str(out), "--data", str(text), "--steps", "3",
               "--batch-size", "2", "--seq-len", "16", "--calib-batches", "1", "--eval-batches", "1",
               "--depth", "3"])
    assert rc == 0
    info = json.loads((out / "student.json").read_text())
    assert info["depth"] == 3 and info["sigma2"] > 0 and "prefill_top1" in info["eval_after"]
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3
    load_student(out)
    assert token_stream(ByteTokenizer(), str(text)).numel() == len(text.read_text()) + 1
    # the student remembers its teacher's weights: the same weights (FP32 or BF16) load quietly, other weights
    # of the same shape load with a warning naming the teacher it was fitted to
    from megaloop.hf.load import load_model
    from megaloop.post.distill.student_lm import load_student_for

    assert len(info["teacher_digest"]) == 64
    for dtype in (torch.float32, torch.bfloat16):
        load_model(hf_dir, dtype=dtype, student=out)
        assert "warning" not in capsys.readouterr().err
    load_model(hf_dir, dtype=torch.float16, student=out)  # FP16 rounding cannot match: said, not misreported
    err = capsys.readouterr().err
    assert "warning" not in err and "under --dtype fp16 megaloop cannot check" in err, err
    model, _ = load_model(hf_dir)
    with torch.no_grad():
        next(model.parameters()).add_(1e-2)
    load_student_for(model, out)
    err = capsys.readouterr().err
    assert "warning: --student" in err and "distilled from other weights of the same shape" in err
    assert str(hf_dir) in err
    # a student.json of the wrong shape was an AttributeError / TypeError traceback in generate
    import shutil

    from megaloop.config_utils import ConfigError

    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    for content, words in (([], "not a megaloop"), ({**info, "teacher_config": 5}, "'teacher_config' must be of type dict"),
                           ({**info, "num_layers": "2"}, "'num_layers' must be of type int")):
        (bad / "student.json").write_text(json.dumps(content))
        with pytest.raises(ConfigError, match=f"^--student: {bad}") as e:
            load_student_for(model, bad)
        assert words in str(e.value), e.value


def test_token_stream_reports_a_cut_short_read(tmp_path):
    """--max-chars stops at whole documents and says so (the CLI prints the counts to stderr)."""

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": "x" * 10}) + "\n" for _ in range(5)))
    info: dict = {}
    ids = token_stream(ByteTokenizer(), str(data), max_chars=25, info=info)
    assert ids.numel() == 3 * 11  # three whole documents (30 >= 25 characters), each + EOS
    assert info == {"documents_read": 3, "documents": 5, "characters_read": 30, "truncated": True}
    token_stream(ByteTokenizer(), str(data), max_chars=None, info=info)
    assert info["truncated"] is False and info["documents_read"] == 5


def test_lr_schedule_warms_up_to_lr_then_decays():
    """Linear warm-up to --lr over --warmup steps, then cosine decay to min_lr_ratio·lr at the last step
    (the cosine started at step 0 and multiplied the ramp: --steps 30 --warmup 20 --lr 1e-3 peaked at
    4.36e-4)."""
    from megaloop.post.distill.prefill_student import DistillConfig, lr_at

    cfg = DistillConfig(steps=30, warmup=20, lr=1e-3)
    lrs = [lr_at(cfg, s) for s in range(30)]
    assert max(lrs) == pytest.approx(1e-3) and lrs[19] == pytest.approx(1e-3)
    assert lrs[:20] == pytest.approx([1e-3 * (s + 1) / 20 for s in range(20)])  # linear ramp
    assert all(a > b for a, b in zip(lrs[19:], lrs[20:]))  # then strictly decaying ...
    assert lrs[-1] == pytest.approx(cfg.min_lr_ratio * 1e-3)  # ... to min_lr_ratio·lr at the last step
    # no warm-up: the cosine starts at --lr
    flat = DistillConfig(steps=10, warmup=0, lr=2e-3)
    assert lr_at(flat, 0) == pytest.approx(2e-3) and lr_at(flat, 9) == pytest.approx(2e-4)
    # a pure function of the step: a resumed run trains at the same LRs
    assert [lr_at(cfg, s) for s in range(30)] == lrs
    # the default warm-up (20) on a shorter run is shortened to steps - 1: --lr is still reached
    short = DistillConfig(steps=4, lr=1e-3)
    assert short.warmup == 20 and [lr_at(short, s) for s in range(4)] == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3, 1e-4])
    assert lr_at(DistillConfig(steps=1, lr=1e-3), 0) == pytest.approx(1e-3)
