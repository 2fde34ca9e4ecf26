"""`megaloop rl grad-check`: reuse vs recompute gradient cosine on a trained tiny model."""

from __future__ import annotations

import json

import pytest

from megaloop.post.rl.grad_check import grad_check
from megaloop.post.rl.grpo import GRPOConfig
from megaloop.post.rl.reuse import ARMS
from megaloop.post.rl.tasks import ArithmeticTask, ByteTokenizer, CallableRewardTask

pytestmark = pytest.mark.usefixtures("one_thread")


def digit_share(example, completion: str) -> float:
    return sum(ch.isdigit() or ch == " " for ch in completion) / max(1, len(completion))


def test_grad_check_cosines(tiny_teacher):
    model, _ = tiny_teacher
    task = CallableRewardTask(ArithmeticTask("+"), digit_share)
    cfg = GRPOConfig(depth=5, neumann_b=5, group_size=4, prompts_per_step=3, max_new_tokens=6, seed=2)
    res = grad_check(model, ByteTokenizer(), task, cfg, ARMS)
    assert res["rows"] == 12 and res["batches_with_signal"] >= 1
    assert res["cosine_reuse_recompute"] > 0.95  # the paper's appendix check on a settled model
    assert res["cosine_reuse_bptt"] > 0.8 and res["grad_norm_reuse"] > 0
    assert all(p.grad is None for p in model.parameters())  # gradients left cleared


def test_grad_check_command(tiny_teacher, capsys):
    from megaloop.post.rl.cli import main

    _, hf_dir = tiny_teacher
    rc = main(["grad-check", "--model", str(hf_dir), "--task", "arithmetic", "--prompts", "2", "--group-size", "2",
               "--depth", "2", "--neumann-b", "2", "--max-new-tokens", "2"])
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["rows"] == 4 and res["depth"] == 2
    assert rc == (1 if "error" in res else 0)
    if rc == 0:
        assert -1.0 <= res["cosine_reuse_recompute"] <= 1.0
    assert main(["grad-check", "--model", str(hf_dir), "--task", "bogus"]) == 2
