"""GRPO loop, rollouts with saved endpoints, exact rewards, reuse vs recompute on a trained model, CLI."""

from __future__ import annotations

import json
import random

import pytest
import torch

from megaloop.post.rl.grpo import (GRPOConfig, GRPOTrainer, generate_with_endpoints, group_advantages, rollout,
                              surrogate_loss)
from megaloop.post.rl.parts import HFLoopedParts
from megaloop.post.rl.reuse import ARMS, backward, cosine, endpoint, flat_grad
from megaloop.post.rl.tasks import (ArithmeticTask, ByteTokenizer, CallableRewardTask, Example, ExactAnswerReward,
                               FinalNumberReward, JsonlTask, RewardFn, make_task)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def digit_share(example: Example, completion: str) -> float:
    """Dense shaped reward (share of digits/spaces) so an untuned model's groups differ."""
    return sum(ch.isdigit() or ch == " " for ch in completion) / max(1, len(completion))


def test_rewards_are_exact(tmp_path):
    task = ArithmeticTask("+-")
    ex = task.make(9, "+", 8)
    assert ex.prompt == "9+8=" and ex.answer == "17"
    r = ExactAnswerReward()
    assert isinstance(r, RewardFn)
    for text, want in (("17", 1.0), ("17\n", 1.0), (" 17 is it", 1.0), ("172", 0.0), ("1", 0.0),
                       ("", 0.0), ("x17", 0.0), ("017", 0.0), ("-17", 0.0)):
        assert task.reward(ex, text) == want, text
    rng = random.Random(0)
    for e in task.sample(200, rng):
        a, b, op = e.meta["a"], e.meta["b"], e.meta["op"]
        assert int(e.answer) == (a + b if op == "+" else a - b) >= 0
        assert e.prompt == f"{a}{op}{b}=" and task.reward(e, e.answer + "\n") == 1.0
    f = FinalNumberReward()
    gsm = Example("q", "1,250")
    assert f(gsm, "so 1000 + 250 = 1250") == 1.0 and f(gsm, "#### 1250.0 then 7") == 1.0
    assert f(gsm, "1250 apples, 3 left") == 0.0 and f(gsm, "no number") == 0.0
    path = tmp_path / "gsm.jsonl"
    path.write_text(json.dumps({"prompt": "2 + 2?", "answer": "4", "id": 7}) + "\n")
    t = make_task(f"gsm8k:{path}")
    (e,) = t.sample(1, rng)
    assert e.prompt == "Question: 2 + 2?\nAnswer:" and e.meta == {"id": 7} and t.reward(e, "It is 4.") == 1.0
    assert isinstance(JsonlTask(path), JsonlTask)
    # GSM8K as published: "question", and the worked answer ending "#### N" (its final number is the answer)
    path.write_text(json.dumps({"question": "Tom has 3 and buys 4 more. How many?",
                                "answer": "3 + 4 = <<3+4=7>>7\n#### 7"}) + "\n")
    (e,) = make_task(f"gsm8k:{path}").sample(1, rng)
    assert e.prompt == "Question: Tom has 3 and buys 4 more. How many?\nAnswer:" and e.answer == "7"
    path.write_text(json.dumps({"text": "x", "answer": "1"}) + "\n")
    with pytest.raises(ValueError, match=r"gsm.jsonl:1: missing key 'prompt' \(or GSM8K's 'question'\)"):
        make_task(f"gsm8k:{path}")
    with pytest.raises(ValueError):
        make_task("nope")


def test_jsonl_task_edges(tmp_path, capsys):
    """An audit of the RL task files: floats made integers past 2^53 equal and a 309-digit number raise
    OverflowError mid-run; a record holding U+2028 was split inside its string; an empty exact: answer
    rewarded an empty completion; "answer": 7.0 under exact: never matched "7"."""
    f = FinalNumberReward()
    assert f(Example("q", "12345678901234567891"), "so 12345678901234567890") == 0.0
    assert f(Example("q", "9007199254740993"), "9007199254740993") == 1.0
    assert f(Example("q", "5"), "x " + "9" * 400) == 0.0 and f(Example("q", "1" * 400), "1" * 400) == 1.0
    assert f(Example("q", "-0"), "0") == 1.0 and f(Example("q", "2.50"), "#### 2.5") == 1.0
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"prompt": "a\u2028b\u0085c 1+1=", "answer": "2"}, ensure_ascii=False) + "\r\n"
                    + json.dumps({"prompt": "3+4=", "answer": 7.0}) + "\n", encoding="utf-8")
    task = make_task(f"exact:{path}")
    assert [e.answer for e in task.examples] == ["2", "7"] and "\u2028" in task.examples[0].prompt
    capsys.readouterr()
    for blank in ("", "   "):  # allowed (a task may train stopping at once), but said: it was silent
        path.write_text(json.dumps({"prompt": "1+1=", "answer": blank}) + "\n")
        make_task(f"exact:{path}")
        assert "1 of 1 answers are empty: the reward is 1 for a completion that ends at once" in capsys.readouterr().err
    path.write_text('{"prompt": "1+1=", "answer": NaN}\n')
    with pytest.raises(ValueError, match="'answer' is nan: give a finite number"):
        make_task(f"exact:{path}")


def test_group_advantages():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    g = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    a = group_advantages(r, g)
    assert torch.allclose(a[:4], (r[:4] - 0.25) / (r[:4].std() + 1e-6))
    assert torch.equal(a[4:], torch.zeros(4))
    assert torch.allclose(group_advantages(r, g, scale=False)[:4], r[:4] - 0.25)


def test_rollout_saves_endpoints(tiny_teacher):
    model, _ = tiny_teacher
    parts = HFLoopedParts(model)
    prompt = torch.tensor([list(b"3+4=")] * 3)
    gen = torch.Generator().manual_seed(0)
    comp, mask, ends = generate_with_endpoints(model, prompt, max_new_tokens=5, depth=5, eos_id=256,
                                               vocab_limit=257, generator=gen, cache_mode="per_visit")
    assert comp.shape[1] <= 5 and ends.shape == (3, 4 + comp.shape[1] - 1, model.config.hidden_size)
    assert int(comp.max()) < 257
    # per-visit token-by-token decoding equals the parallel pass, so every saved endpoint is z^R
    seq = torch.cat([prompt, comp], 1)[:, :-1]
    ref = endpoint(parts, seq, 5)
    assert torch.allclose(ends, ref, atol=2e-5, rtol=1e-4), float((ends - ref).abs().max())
    # mask: ones up to and including the first EOS, zeros after
    for row in range(comp.shape[0]):
        toks = comp[row].tolist()
        n = toks.index(256) + 1 if 256 in toks else len(toks)
        assert mask[row].tolist() == [1.0] * n + [0.0] * (len(toks) - n)


@pytest.mark.parametrize("arm", ARMS)
def test_grpo_steps_each_arm(tiny_teacher, arm):
    model, _ = tiny_teacher
    model = type(model)(model.config).eval()  # a private copy: the updates must not leak into other tests
    model.load_state_dict(tiny_teacher[0].state_dict())
    tok = ByteTokenizer()
    task = CallableRewardTask(ArithmeticTask("+"), digit_share)
    cfg = GRPOConfig(arm=arm, depth=4, neumann_b=3, group_size=4, prompts_per_step=2,
                     max_new_tokens=4, lr=1e-3, seed=1)
    trainer = GRPOTrainer(model, tok, task, cfg, log=None)
    before = [p.detach().clone() for p in model.parameters()]
    stepped = False
    for _ in range(2):
        rec = trainer.step()
        for batch in trainer.last_batches:
            # rewards are recomputed exactly from the generated ids
            for row in range(batch.ids.shape[0]):
                toks = batch.ids[row, batch.prompt_len:].tolist()
                n = int(batch.mask[row].sum())
                text = tok.decode([t for t in toks[:n] if t != tok.eos_id])
                assert text == batch.completions[row]
                assert batch.rewards[row].item() == pytest.approx(digit_share(batch.examples[row], text), abs=1e-7)
            assert batch.endpoints.shape[1] == batch.ids.shape[1] - 1
        assert rec["arm"] == arm and 0.0 <= rec["reward_mean"] <= 1.0
        if rec["grad_norm"] is not None:
            stepped = True
            assert rec["grad_norm"] > 0 and torch.isfinite(torch.tensor(rec["loss"]))
    assert stepped
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_reuse_vs_recompute_cosine_on_trained_model(tiny_teacher):
    """Whole-model gradient cosine of reuse (terminal-cache rollout endpoints) vs recompute."""
    model, _ = tiny_teacher
    parts = HFLoopedParts(model)
    tok = ByteTokenizer()
    task = CallableRewardTask(ArithmeticTask("+"), digit_share)
    cfg = GRPOConfig(arm="reuse", depth=5, neumann_b=5, group_size=6, prompts_per_step=2,
                     max_new_tokens=8, seed=3)
    batches = rollout(model, tok, task, task.sample(2, random.Random(3)), cfg, torch.Generator().manual_seed(3))
    batch = batches[0]
    assert batch.advantages.abs().sum() > 0
    params = parts.parameters()
    n_seq, n_tok = batch.ids.shape[0], int(batch.mask.sum())
    grads, stats = {}, {}
    for arm in ARMS:
        model.zero_grad(set_to_none=True)
        stats[arm] = backward(arm, parts, batch.ids[:, :-1], surrogate_loss(batch, cfg, n_seq, n_tok),
                              depth=5, b=5, z_end=batch.endpoints)
        grads[arm] = flat_grad(params)
    model.zero_grad(set_to_none=True)
    assert cosine(grads["reuse"], grads["recompute"]) >= 0.99
    assert cosine(grads["reuse"], grads["bptt"]) >= 0.95
    assert stats["reuse"].residual < 0.05 and stats["recompute"].residual < 0.05


def test_cli_round_trip(tiny_teacher, tmp_path):
    from megaloop.hf.modeling_megaloop import MegaloopForCausalLM
    from megaloop.post.rl.cli import main

    _, hf_dir = tiny_teacher
    out = tmp_path / "rl"
    rc = main(["--model", str(hf_dir), "--out", str(out), "--task", "arithmetic", "--arm", "reuse",
               "--depth", "3", "--neumann-b", "2", "--steps", "2", "--group-size", "2", "--prompts", "2",
               "--max-new-tokens", "3", "--lr", "1e-4"])
    assert rc == 0
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[0])["arm"] == "reuse"
    summary = json.loads((out / "megaloop_rl.json").read_text())
    assert summary["config"]["neumann_b"] == 2 and summary["source"]["kind"] == "hf"
    reloaded = MegaloopForCausalLM.from_pretrained(str(out))
    assert reloaded.config.num_recurrences == 3
    assert (out / "modeling_megaloop.py").is_file() and (out / "megaloop_tokenizer.json").is_file()
    assert main(["--model", str(hf_dir), "--out", str(tmp_path / "x"), "--task", "bogus"]) == 2


def test_a_kill_during_a_save_keeps_the_steps_metrics_line_and_latest_has_its_sidecar(tiny_teacher, tmp_path):
    """The record went to metrics.jsonl after the save and rl_run.json after `latest` moved: a kill right
    after a save lost that step's line for good (a resume starts after it) and left `latest` naming a
    step without its sidecar. Both are written before the save now."""
    model, _ = tiny_teacher
    model = type(model)(model.config).eval()
    model.load_state_dict(tiny_teacher[0].state_dict())
    cfg = GRPOConfig(arm="reuse", depth=2, neumann_b=2, group_size=2, prompts_per_step=1, max_new_tokens=2,
                     lr=1e-3, seed=1)
    trainer = GRPOTrainer(model, ByteTokenizer(), CallableRewardTask(ArithmeticTask("+"), digit_share), cfg,
                          log=None)
    real = trainer.engine.save

    def killed(directory, tag, state):
        assert (tmp_path / "ck" / tag / "rl_run.json").is_file()  # the sidecar is there first
        real(directory, tag, state)
        if tag == "step000002":
            raise KeyboardInterrupt  # as a kill between the save and the record
    trainer.engine.save = killed
    with pytest.raises(KeyboardInterrupt):
        trainer.train(steps=3, metrics_path=tmp_path / "m.jsonl", save_dir=tmp_path / "ck", save_every=1)
    lines = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1]  # the saved step 2 (record step 1) kept its line
    assert (tmp_path / "ck" / "latest").read_text().strip() == "step000002"
