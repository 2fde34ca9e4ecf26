"""The evaluation memory check (megaloop.eval.memory): the estimates against a hand computation and
the refusals' messages (the commands refusing before the first forward: tests/eval/test_cli.py)."""

from __future__ import annotations

import types

import pytest
import torch

from megaloop.config_utils import ConfigError
from megaloop.eval.memory import HEADROOM, available_memory, check_eval_memory, estimate_eval_memory
from megaloop.hf import MegaloopConfig

# 1/2/1 layers, d=32, 4 heads of 8, 2 KV heads, ffn 96, 48 head rows
CFG = MegaloopConfig(vocab_size=48, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=96, n_prelude=1, n_core=2, n_coda=1, injection="parcae_decay")


def test_native_estimate_is_logits_log_softmax_and_one_layer_visit():
    est = estimate_eval_memory(CFG, batch_size=3, seq_len=10, prefix_len=5, depth=4)
    logits = 3 * 10 * 48 * (4 + 4)  # FP32 output + log-softmax
    act = 3 * 10 * (7 * 32 + 3 * 96) * 4
    assert (est.peak_protocol, est.logits_bytes, est.kv_bytes, est.activation_bytes) == ("native", logits, 0, act)
    assert est.total_bytes == logits + act
    half = estimate_eval_memory(CFG, batch_size=3, seq_len=10, prefix_len=5, depth=4, dtype=torch.bfloat16)
    assert half.logits_bytes == 3 * 10 * 48 * (2 + 4 + 4)  # bf16 output, its FP32 copy, log-softmax
    assert half.activation_bytes == act // 2


@pytest.mark.parametrize("mode,banks", [("terminal", 4), ("per_visit", 1 + 2 * 6 + 1)])
def test_cache_estimate_counts_banks_capacity_pending_tokens_and_mask(mode, banks):
    # prefix 3 of 10: capacity max(10, 6) = 10, 7 scored tokens held before commit; depth max(4, P=6)
    est = estimate_eval_memory(CFG, batch_size=2, seq_len=10, prefix_len=3, depth=4, prefill_depth=6,
                               protocols=(mode,))
    per_token = banks * 2 * 2 * 8 * 4  # banks × (K, V) × kv heads × head_dim × fp32
    assert est.kv_bytes == 2 * (10 + 7) * per_token
    assert est.logits_bytes == 2 * 7 * 48 * 8
    assert est.activation_bytes == 2 * 10 * (7 * 32 + 3 * 96) * 4 + 7 * 10 * 5
    # a long prefix doubles the bank past L: prefix 8 of 10 → capacity 16, 2 scored
    long = estimate_eval_memory(CFG, batch_size=1, seq_len=10, prefix_len=8, depth=6, protocols=(mode,))
    assert long.kv_bytes == (16 + 2) * per_token


def test_peak_is_the_largest_pass():
    est = estimate_eval_memory(CFG, batch_size=2, seq_len=64, prefix_len=32, depth=32,
                               protocols=("native", "terminal", "per_visit"))
    assert set(est.per_protocol) == {"native", "terminal", "per_visit"}
    assert est.peak_protocol == "per_visit" and est.total_bytes == max(est.per_protocol.values())
    assert est.per_protocol["terminal"] < est.per_protocol["per_visit"]


def _engine():
    return types.SimpleNamespace(config=CFG, dtype=torch.float32, device=torch.device("cpu"))


def test_check_refuses_naming_the_flags_and_a_batch_that_fits(monkeypatch):
    est = estimate_eval_memory(CFG, batch_size=8, seq_len=64, prefix_len=32, depth=4)
    per_seq = est.total_bytes / 8
    monkeypatch.setenv("MEGALOOP_EVAL_MEMORY", str(int(3.5 * per_seq / HEADROOM)))
    with pytest.raises(ConfigError) as err:
        check_eval_memory(_engine(), batch_size=8, seq_len=64, prefix_len=32, depths=[4])
    msg = str(err.value)
    assert msg.startswith("--batch-size 8 × --seq-len 64: the native pass needs an estimated")
    assert "--batch-size 3 fits" in msg and "--no-memory-check" in msg
    assert check_eval_memory(_engine(), batch_size=3, seq_len=64, prefix_len=32, depths=[4]).batch_size == 3
    # not even one sequence: the message says to shorten it, and which protocol to drop
    monkeypatch.setenv("MEGALOOP_EVAL_MEMORY", "1000")
    with pytest.raises(ConfigError, match="even one sequence does not fit: lower --seq-len or drop a protocol"):
        check_eval_memory(_engine(), batch_size=1, seq_len=64, prefix_len=32, depths=[4],
                          protocols=("native", "terminal"))
    # the deepest depth decides (per-visit banks grow with R)
    monkeypatch.setenv("MEGALOOP_EVAL_MEMORY", str(int(1.01 * estimate_eval_memory(
        CFG, batch_size=1, seq_len=64, prefix_len=32, depth=2, protocols=("per_visit",)).total_bytes / HEADROOM)))
    check_eval_memory(_engine(), batch_size=1, seq_len=64, prefix_len=32, depths=[1, 2], protocols=("per_visit",))
    with pytest.raises(ConfigError, match="the per_visit pass"):
        check_eval_memory(_engine(), batch_size=1, seq_len=64, prefix_len=32, depths=[1, 2, 16],
                          protocols=("per_visit",))


def test_available_memory(monkeypatch):
    monkeypatch.delenv("MEGALOOP_EVAL_MEMORY", raising=False)
    assert available_memory(torch.device("cpu")) > 0
    monkeypatch.setenv("MEGALOOP_EVAL_MEMORY", "2e9")
    assert available_memory(torch.device("cpu")) == 2_000_000_000
    monkeypatch.setenv("MEGALOOP_EVAL_MEMORY", "lots")
    with pytest.raises(ConfigError, match="MEGALOOP_EVAL_MEMORY: a number of bytes, got 'lots'"):
        available_memory(torch.device("cpu"))


def test_state_trace_estimate_and_refusal(monkeypatch):
    from megaloop.eval.memory import check_trace_memory, estimate_trace_memory

    # e, R+1 states and 2 injection parts per recurrence: (3R + 2) tensors [n, L, d], + one layer visit
    need = estimate_trace_memory(CFG, num_seqs=4, seq_len=16, depth=8)
    assert need == (3 * 8 + 2) * 4 * 16 * 32 * 4 + 4 * 16 * (7 * 32 + 3 * 96) * 4
    monkeypatch.setenv("MEGALOOP_EVAL_MEMORY", str(int(2.5 * need / 4 / HEADROOM)))
    with pytest.raises(ConfigError, match=r"^--max-seqs 4 × --seq-len 16 at --depth 8: the state trace needs an "
                                          r"estimated .* --max-seqs 2 fits"):
        check_trace_memory(_engine(), num_seqs=4, seq_len=16, depth=8)
    assert check_trace_memory(_engine(), num_seqs=2, seq_len=16, depth=8) == need // 2
