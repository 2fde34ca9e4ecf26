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
    act = 3 * 10 * (9 * 32 + 4 * 96) * 4
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
    assert est.activation_bytes == 2 * 10 * (9 * 32 + 4 * 96) * 4 + 7 * 10 * 5
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

    # streamed: 12 tensors [n, L, d] whatever the depth (the full trace held 3R + 2), + one layer visit
    need = estimate_trace_memory(CFG, num_seqs=4, seq_len=16, depth=8)
    assert need == 12 * 4 * 16 * 32 * 4 + 4 * 16 * (9 * 32 + 4 * 96) * 4
    assert estimate_trace_memory(CFG, num_seqs=4, seq_len=16, depth=100_000) == need
    monkeypatch.setenv("MEGALOOP_EVAL_MEMORY", str(int(2.5 * need / 4 / HEADROOM)))
    with pytest.raises(ConfigError, match=r"^--max-seqs 4 × --seq-len 16 at --depth 8: the state trace needs an "
                                          r"estimated .* --max-seqs 2 fits"):
        check_trace_memory(_engine(), num_seqs=4, seq_len=16, depth=8)
    assert check_trace_memory(_engine(), num_seqs=2, seq_len=16, depth=8) == need // 2


def test_bank_capacity_follows_the_cache_growth():
    from megaloop.eval.memory import bank_capacity
    from megaloop.hf.cache_megaloop import _Bank

    assert bank_capacity(5, 5) == 5  # never grown
    assert bank_capacity(5, 6) == 16  # max(n + 1, 2 × 5, 16)
    assert bank_capacity(20, 41) == 80  # 20 → 40 → 80
    for p, total in ((1, 1), (3, 40), (17, 18), (20, 41), (100, 700)):  # the real bank, grown a token at a time
        bank = _Bank(torch.zeros(1, 1, p, 1), torch.zeros(1, 1, p, 1))
        for _ in range(total - p):
            bank.append(torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 1, 1))
        assert bank.k.shape[2] == bank_capacity(p, total), (p, total)


def test_decode_estimate_by_phase_against_a_hand_computation():
    from megaloop.eval.memory import estimate_decode_memory

    # 2 prompts of up to 6 tokens decoded until 20 tokens; per-visit banks at max(P=3, D=5): 1 + 2·5 + 1 = 12
    est = estimate_decode_memory(CFG, batch_size=2, prompt_len=6, total_len=20, prefill_depth=3, decode_depth=5,
                                 mode="per_visit")
    per_token = 12 * 2 * 2 * 8 * 4
    layer = 9 * 32 + 4 * 96
    prefill = 2 * 48 * 8 + 2 * 6 * per_token + 2 * 6 * layer * 4 + 5 * 2 * 6 * 6  # + the padded [2,1,6,6] mask
    # banks grow 6 → 16 → 32; one row finishing early copies the other's 20 tokens while the old cache lives
    decode_kv = (2 * 32 + 1 * 20) * per_token
    decode = 2 * 48 * 8 + decode_kv + 2 * layer * 4 + 5 * 2 * 20
    assert est.per_protocol == {"prefill": prefill, "decode": decode}
    assert (est.peak_protocol, est.kv_bytes, est.total_bytes, est.seq_len) == ("decode", decode_kv, decode, 20)
    # one row, terminal banks (4), prompts not padded: no copy, no prefill mask; the transient is one
    # bank's K/V of 20 tokens read by attention
    one = estimate_decode_memory(CFG, batch_size=1, prompt_len=6, total_len=20, prefill_depth=3, decode_depth=5,
                                 mode="terminal", padded=False)
    assert one.kv_bytes == 32 * 4 * 2 * 2 * 8 * 4 + 20 * 2 * 2 * 8 * 4
    assert one.per_protocol["prefill"] == 48 * 8 + 6 * 4 * 2 * 2 * 8 * 4 + 6 * layer * 4


def test_decode_positions_count_the_padding_of_shorter_prompts():
    from megaloop.eval.memory import decode_positions

    assert decode_positions([10, 10], 5, 100) == 14  # prompt + every generated token but the last
    assert decode_positions([10, 10], 500, 100) == 100  # stopped by the context
    assert decode_positions([30, 10], 500, 100) == 120  # the 10-token row runs to 100 real tokens behind 20 pads


def test_decode_check_refuses_with_the_callers_wording(monkeypatch):
    from megaloop.eval.memory import check_decode_memory, estimate_decode_memory

    kw = dict(prompt_len=16, total_len=64, prefill_depth=4, decode_depth=32, mode="per_visit")
    need = estimate_decode_memory(CFG, batch_size=8, **kw).total_bytes
    monkeypatch.setenv("MEGALOOP_EVAL_MEMORY", str(int(3.5 * need / 8 / HEADROOM)))
    with pytest.raises(ConfigError) as err:
        check_decode_memory(_engine(), batch_size=8, what="8 prompt(s)", fits="{n} prompt(s) at a time fit",
                            shrink="use --cache terminal", **kw)
    msg = str(err.value)
    assert msg.startswith("8 prompt(s) (64 tokens held per row, per_visit cache at depth 32): the decode phase "
                          "needs an estimated"), msg
    assert "3 prompt(s) at a time fit" in msg and "--no-memory-check" in msg
    monkeypatch.setenv("MEGALOOP_EVAL_MEMORY", "1000")
    with pytest.raises(ConfigError, match="even one sequence does not fit: use --cache terminal"):
        check_decode_memory(_engine(), batch_size=1, what="x", fits="{n}", shrink="use --cache terminal", **kw)
    monkeypatch.setenv("MEGALOOP_EVAL_MEMORY", str(int(2 * need)))
    assert check_decode_memory(_engine(), batch_size=8, what="x", fits="{n}", shrink="", **kw).total_bytes == need


def _harness(monkeypatch, **kw):
    """A MegaloopLM over a stand-in engine (only what the memory check reads)."""
    from megaloop.eval.harness import MegaloopLM

    eng = types.SimpleNamespace(config=CFG, dtype=torch.float32, device=torch.device("cpu"), tokenizer=object(),
                                depth=4, prefill_depth=4, decode_depth=4, max_context=256, exit=None,
                                encode=lambda text: [1] * len(text))
    return MegaloopLM(eng, **kw)


@pytest.mark.parametrize("kw,phrase", [
    ({"cache_mode": "per_visit", "depth": 32}, "the decode phase"),
    ({"cache_mode": "per_visit", "scoring": "parallel", "depth": 32}, "one parallel pass at depth 32"),
    ({"cache_mode": "none", "depth": 32}, "one parallel pass at depth 32"),
])
def test_harness_checks_the_longest_requests_in_every_scoring_mode(monkeypatch, kw, phrase):
    from megaloop.eval import decode_score

    for name in ("decode_loglikelihood", "parallel_loglikelihood"):
        monkeypatch.setattr(decode_score, name, lambda *a, **k: pytest.fail("scored although refused"))
    lm = _harness(monkeypatch, batch_size=16, **kw)
    pairs = [([1] * 200, [2] * 40), ([1] * 10, [2])] * 8
    monkeypatch.setenv("MEGALOOP_EVAL_MEMORY", "200000")
    with pytest.raises(ConfigError) as err:
        lm._loglikelihood_tokens(pairs)
    msg = str(err.value)
    assert msg.startswith("--batch-size 16, contexts of up to 200 tokens, continuations of up to 40") and phrase in msg
    assert "--no-memory-check" in msg
    lm.memory_check = False
    with pytest.raises(pytest.fail.Exception, match="scored although refused"):
        lm._loglikelihood_tokens(pairs)
    assert _harness(monkeypatch, memory_check="false").memory_check is False


def test_harness_generate_until_checks_the_longest_generation(monkeypatch):
    lm = _harness(monkeypatch, cache_mode="per_visit", decode_depth=64)
    lm.engine.generate = lambda *a, **k: pytest.fail("generated although refused")
    req = types.SimpleNamespace(args=("x" * 100, {"max_gen_toks": 150, "until": ["\n"]}))
    monkeypatch.setenv("MEGALOOP_EVAL_MEMORY", "100000")
    with pytest.raises(ConfigError, match=r"^--batch-size 1, contexts of up to 100 tokens, continuations of up to "
                                          r"150 \(249 tokens held per row, per_visit cache at depth 64\)"):
        lm.generate_until([req])


def test_copy_estimate_is_the_native_pass_plus_the_probes_logits_copy(monkeypatch):
    from megaloop.eval.memory import check_copy_memory, estimate_copy_memory

    need = estimate_copy_memory(CFG, num_seqs=4, seq_len=20)
    # logits + log-softmax (native pass), one layer visit, + the FP32 copy of the shifted logits [4, 19, 48]
    assert need == 4 * 20 * 48 * 8 + 4 * 20 * (9 * 32 + 4 * 96) * 4 + 4 * 19 * 48 * 4
    # under BF16 the FP32 copy the native pass counts is that copy
    bf16 = estimate_eval_memory(CFG, batch_size=4, seq_len=20, prefix_len=0, depth=1, dtype=torch.bfloat16)
    assert estimate_copy_memory(CFG, num_seqs=4, seq_len=20, dtype=torch.bfloat16) == bf16.total_bytes
    monkeypatch.setenv("MEGALOOP_EVAL_MEMORY", str(int(2.5 * need / 4 / HEADROOM)))
    with pytest.raises(ConfigError, match=r"^--num-seqs 4 × 2 · --half-len 10 tokens: the probe's forward needs an "
                                          r"estimated .* --num-seqs 2 fits"):
        check_copy_memory(_engine(), num_seqs=4, half_len=10)
    assert check_copy_memory(_engine(), num_seqs=2, half_len=10) == estimate_copy_memory(CFG, num_seqs=2, seq_len=20)


def test_fixed_point_estimate_by_part_and_the_longest_prefix_that_fits(monkeypatch):
    from megaloop.eval.memory import check_fixed_point_memory, estimate_fixed_point_memory

    t = 50
    need = estimate_fixed_point_memory(CFG, span_len=t, cycle_window=16)
    attention = int(2.5 * 4 * t * t * 4) + 5 * t * t  # scores of 4 heads (×2.5), causal mask + float copy
    states = (16 + 6) * t * 32 * 4
    banks = (2 * 1 + 4 * 2 + 1) * t * (2 * 2 * 8 * 4)  # prelude ×2, core ×4, coda; K+V × 2 kv heads × 8 × fp32
    logits = 2 * 48 * 4  # the readouts keep the last position's logits only
    act = t * (9 * 32 + 4 * 96) * 4
    assert need == attention + states + banks + logits + act
    # quadratic in the span: the hint is the longest prefix whose span fits, found by bisection
    budget = estimate_fixed_point_memory(CFG, span_len=31, cycle_window=16)
    monkeypatch.setenv("MEGALOOP_EVAL_MEMORY", str(int(budget / HEADROOM) + 1))
    with pytest.raises(ConfigError, match=r"^--prefix-len 49: one span's fixed-point solve \(FP32, math attention "
                                          r"over 50 tokens\) needs an estimated .* --prefix-len 30 fits \(--no-memory"):
        check_fixed_point_memory(_engine(), prefix_len=t - 1)
    assert check_fixed_point_memory(_engine(), prefix_len=30) == budget
    monkeypatch.setenv("MEGALOOP_EVAL_MEMORY", "1000")
    with pytest.raises(ConfigError, match="even one sequence does not fit: not even with a one-token --prefix-len"):
        check_fixed_point_memory(_engine(), prefix_len=t - 1)


def test_synth_table_checks_the_deepest_depth_before_the_first(monkeypatch):
    from megaloop.eval import decode_score, synth

    lm = _harness(monkeypatch)
    eng = lm.engine
    scored = []
    monkeypatch.setattr(decode_score, "decode_loglikelihood", lambda *a, **k: scored.append(k) or pytest.fail("scored"))
    problems = [{"prompt": "x" * 100, "target": "y" * 20, "k": 1}]
    # fits per-visit banks at depth 2, not at 64: refused before depth 2 runs
    monkeypatch.setenv("MEGALOOP_EVAL_MEMORY", "2000000")
    with pytest.raises(ConfigError, match="per_visit cache at depth 64"):
        synth.synth_table(eng, problems, [2, 64], cache_mode="per_visit", batch_size=1)
    assert not scored
    for depths, check in (([2], True), ([2, 64], False)):  # depth 2 alone fits; no check: scoring is reached
        with pytest.raises(pytest.fail.Exception, match="scored"):
            synth.synth_table(eng, problems, depths, cache_mode="per_visit", batch_size=1, memory_check=check)
