"""InferenceEngine: prefill = parallel pass then terminal banks, memory accounting, incremental
decoding vs full forward, left-padded batches, sampling, stop conditions, bad inputs.
Pure-PyTorch models built from MegaloopConfig (no megatron, no checkpoint)."""

from __future__ import annotations

import contextlib
from fractions import Fraction

import pytest
import torch

from megaloop.config_utils import ConfigError
from megaloop.inference.kv_cache import (banks_per_token, cache_stats, clone_cache, kv_bytes_per_token,
                                         memory_report, select_rows, terminal_over_per_visit)
from tests.inference.helpers import make_engine

TOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_prefill_is_the_parallel_pass_then_terminal_banks():
    eng = make_engine(depth=4)
    prompt = torch.randint(2, 32, (2, 9), generator=torch.Generator().manual_seed(1))
    full = eng.forward(prompt, depth=4)
    term = eng.prefill(prompt, depth=4, cache_mode="terminal")
    pv = eng.prefill(prompt, depth=4, cache_mode="per_visit")
    # both caches: the prompt's logits are those of the plain parallel forward at the prefill depth
    assert (term.logits - full[:, -1, :32]).abs().max() < TOL
    assert (pv.logits - full[:, -1, :32]).abs().max() < TOL
    # terminal keeps, per core layer, exactly the last visit of the parallel pass; prelude/coda as is
    for i in range(2):
        for a, b in zip(term.cache.read("core", i, 0), pv.cache.banks[("core", i, 3)].view()):
            assert torch.equal(a, b)
        for r in range(3):  # and drops the earlier visits, which differ from the terminal one
            assert not torch.equal(pv.cache.banks[("core", i, r)].view()[0], term.cache.read("core", i, 0)[0])
    for key in (("prelude", 0, 0), ("coda", 0, 0)):
        assert all(torch.equal(a, b) for a, b in zip(term.cache.banks[key].view(), pv.cache.banks[key].view()))
    assert term.cache.num_banks() == 1 + 2 + 1 and pv.cache.num_banks() == 1 + 2 * 4 + 1
    # prefill with a different decode budget: the cache is the same; the budget applies to decoding
    st = eng.prefill(prompt, depth=4, decode_depth=7)
    assert st.prefill_depth == 4 and st.decode_depth == 7


def test_kv_memory_is_four_twelfths_at_R5():
    """1/2/1 layers, R=5: terminal keeps 4 of 12 banks per token (engine accounting, measured)."""
    assert banks_per_token("terminal", 5, 1, 2, 1) == 4 and banks_per_token("per_visit", 5, 1, 2, 1) == 12
    assert terminal_over_per_visit(5, 1, 2, 1) == Fraction(4, 12)
    eng = make_engine(depth=5)
    prompt = torch.randint(2, 32, (3, 10), generator=torch.Generator().manual_seed(2))
    term = eng.prefill(prompt, depth=5, cache_mode="terminal").cache
    pv = eng.prefill(prompt, depth=5, cache_mode="per_visit").cache
    assert Fraction(term.kv_bytes(), pv.kv_bytes()) == Fraction(4, 12)
    st_t, st_p = cache_stats(term), cache_stats(pv)
    assert (st_t.banks, st_p.banks, st_t.tokens, st_t.batch_size) == (4, 12, 10, 3)
    # predicted bytes/token = banks x 2 (K, V) x kv_heads x head_dim x 4 bytes
    assert st_t.bytes_per_token == eng.kv_bytes_per_token("terminal", 5) == 4 * 2 * 2 * 8 * 4
    assert st_p.bytes_per_token == eng.kv_bytes_per_token("per_visit", 5) == 12 * 2 * 2 * 8 * 4
    assert kv_bytes_per_token(eng.config, "terminal", 5, torch.bfloat16) == 4 * 2 * 2 * 8 * 2
    rep = memory_report(eng.config, "per_visit", 5, tokens=10, batch_size=3)
    assert rep.total_bytes == pv.kv_bytes() and rep.terminal_over_per_visit == "1/3"
    # generation stats expose the same numbers (+ timing)
    out = eng.generate([[3, 4, 5]], max_new_tokens=4, decode_depth=5, stop_at_eos=False)
    s = out.stats
    assert s.kv_bytes_per_token == s.kv_bytes_per_token_terminal == st_t.bytes_per_token
    assert s.kv_bytes_per_token_per_visit == st_p.bytes_per_token
    assert s.generated_tokens == 4 and s.decode_steps == 3 and s.prefill_s > 0 and s.decode_tokens_per_s > 0
    # the first token comes from the prefill: the decode rate counts the 3 tokens fed (it counted 4)
    assert s.decode_tokens == 3 and abs(s.decode_tokens_per_s * s.decode_s - 3) < 1e-6
    assert s.kv_bytes_peak == 6 * st_t.bytes_per_token  # 3 prompt + 3 fed tokens


def test_predicted_per_visit_bytes_count_the_deepest_pass_the_cache_holds():
    """The per-visit prediction used the decode depth alone: 8192 B/token printed beside a measured
    18432 with --prefill-depth 8 --decode-depth 3, and beside 22528 under an exit with max depth 10."""
    from megaloop.eval.ppl import evaluate_ppl
    from megaloop.eval.text_data import EvalData

    eng = make_engine(depth=3)
    banks = lambda r: 1 + 2 * r + 1  # noqa: E731 - tiny engine: 1/2/1 layers
    per_bank = 2 * 2 * 8 * 4
    s = eng.generate([[3, 4, 5]], max_new_tokens=3, prefill_depth=8, decode_depth=3, stop_at_eos=False,
                     cache_mode="per_visit").stats
    assert s.kv_bytes_per_token == s.kv_bytes_per_token_per_visit == banks(8) * per_bank
    s = eng.generate([[3, 4, 5]], max_new_tokens=3, exit_criterion="latent:0", max_depth=10, stop_at_eos=False,
                     cache_mode="per_visit").stats
    assert s.decode_depth == 10 and s.kv_bytes_per_token == s.kv_bytes_per_token_per_visit == banks(10) * per_bank
    tokens = torch.randint(2, 32, (2, 8), generator=torch.Generator().manual_seed(3))
    data = EvalData(tokens=tokens, labels=torch.roll(tokens, -1, 1), loss_mask=torch.ones(2, 8), source="test")
    res = evaluate_ppl(eng, data, depth=3, prefill_depth=5, protocols=("per_visit",), batch_size=2)
    assert res.kv_bytes_per_token["per_visit"] == banks(5) * per_bank


def test_incremental_decoding_agrees_with_full_forward_per_visit():
    eng = make_engine(depth=3, seed=4)
    prompt = [5, 9, 2, 14, 7]
    out = eng.generate(prompt, max_new_tokens=8, cache_mode="per_visit", return_logits=True, stop_at_eos=False)
    gen = out.results[0].token_ids
    assert len(gen) == 8
    full = eng.forward(torch.tensor([prompt + gen]), depth=3)[0, len(prompt) - 1:-1, :32]
    err = (out.results[0].logits - full).abs().max().item()
    assert err < 1e-4, f"per-visit incremental decoding vs parallel forward: {err:.2e}"
    assert gen == full.argmax(-1).tolist()
    # terminal sharing is *not* the parallel pass (the gap the sharing penalty measures)
    term = eng.generate(prompt, max_new_tokens=8, cache_mode="terminal", return_logits=True, stop_at_eos=False)
    full_t = eng.forward(torch.tensor([prompt + term.results[0].token_ids]), depth=3)[0, len(prompt) - 1:-1, :32]
    gap = (term.results[0].logits - full_t).abs().max().item()
    assert gap > 1e-4, "terminal decoding unexpectedly equals the parallel forward"
    assert (term.results[0].logits[0] - full_t[0]).abs().max() < TOL  # first token: prefill logits


@pytest.mark.parametrize("mode", ["terminal", "per_visit"])
def test_left_padded_batch_equals_single_sequences(mode):
    eng = make_engine(depth=2, prefill_depth=3, decode_depth=2, seed=5)
    prompts = ["hello world", "ab", "looped models think"]
    batch = eng.generate(prompts, max_new_tokens=6, cache_mode=mode, return_logits=True, stop_at_eos=False)
    for p, r in zip(prompts, batch.results):
        one = eng.generate(p, max_new_tokens=6, cache_mode=mode, return_logits=True, stop_at_eos=False).results[0]
        assert r.token_ids == one.token_ids and r.prompt_tokens == len(p)
        assert (r.logits - one.logits).abs().max() < 1e-4


def test_sampling_is_seeded_and_filters():
    eng = make_engine(seed=6)
    kw = dict(max_new_tokens=10, stop_at_eos=False)
    a = eng.generate(["abc", "de"], temperature=1.5, seed=11, **kw)
    b = eng.generate(["abc", "de"], temperature=1.5, seed=11, **kw)
    c = eng.generate(["abc", "de"], temperature=1.5, seed=12, **kw)
    assert a.texts == b.texts and a.texts != c.texts
    greedy = eng.generate(["abc", "de"], **kw).texts
    assert eng.generate(["abc", "de"], temperature=2.0, top_k=1, seed=3, **kw).texts == greedy
    assert eng.generate(["abc", "de"], temperature=2.0, top_p=1e-6, seed=3, **kw).texts == greedy
    # padded vocabulary rows (ids 32..47) are never produced
    hot = eng.generate(["abc"], temperature=50.0, seed=0, max_new_tokens=40, stop_at_eos=False)
    assert max(hot.results[0].token_ids) < 32


def test_a_rows_sample_does_not_depend_on_the_other_rows():
    """One generator served the batch: when another row finished early (a stop string, EOS) every later
    draw shifted, and a row's text changed with its neighbours. Each row now has its own stream."""
    eng = make_engine(seed=6)
    kw = dict(temperature=1.5, seed=11, max_new_tokens=12, stop_at_eos=False)
    both = eng.generate(["abc", "de"], **kw).results
    first = eng.decode_text(both[0].token_ids[:2])
    assert len(first) >= 1 and first not in eng.decode_text(both[1].token_ids)
    cut = eng.generate(["abc", "de"], stop=first, **kw).results  # row 0 now stops early
    assert cut[0].finish_reason == "stop" and len(cut[0].token_ids) < len(both[0].token_ids)
    assert cut[1].token_ids == both[1].token_ids
    assert eng.generate(["abc"], **kw).results[0].token_ids == both[0].token_ids  # row 0: its stream alone too
    assert eng.generate(["abc", "zz", "de"], **kw).results[0].token_ids == both[0].token_ids


@contextlib.contextmanager
def forced(eng, tokens):
    """Make the head emit ``tokens[n]`` at its n-th call (the last one repeats): a forward hook."""
    calls = {"n": 0}

    def hook(_mod, _inp, out):
        tok = tokens[min(calls["n"], len(tokens) - 1)]
        calls["n"] += 1
        out = torch.full_like(out, -10.0)
        out[..., tok] = 10.0
        return out

    handle = eng.model.lm_head.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def test_stop_strings_eos_length_and_context():
    eng = make_engine(max_context=12)
    hi_b = [8, 9, 27, 2, 0]  # "h" "i" " " "b" EOS
    with forced(eng, hi_b):
        r = eng.generate("ab", max_new_tokens=10).results[0]
    assert (r.text, r.finish_reason, r.token_ids) == ("hi b", "eos", [8, 9, 27, 2])
    with forced(eng, hi_b):
        r = eng.generate("ab", max_new_tokens=10, stop=[" b"]).results[0]
    assert (r.text, r.finish_reason) == ("hi", "stop")
    with forced(eng, hi_b):
        r = eng.generate("ab", max_new_tokens=2).results[0]
    assert (r.text, r.finish_reason) == ("hi", "length")
    with forced(eng, hi_b):
        r = eng.generate("ab", max_new_tokens=10, stop_at_eos=False).results[0]
    assert r.token_ids == [8, 9, 27, 2, 0, 0, 0, 0, 0, 0] and r.finish_reason == "length"
    with forced(eng, [5]):  # 10-token prompt, context 12: three tokens come out (the last is never fed)
        r = eng.generate("abcdefghij", max_new_tokens=10).results[0]
    assert (r.text, r.finish_reason) == ("eee", "context")


def test_bad_inputs_raise_clear_errors():
    eng = make_engine(max_context=16)
    with pytest.raises(ConfigError, match="prompt has 20 tokens, longer than the model's context of 16"):
        eng.generate("a" * 20)
    with pytest.raises(ConfigError, match="--prefill-depth: recurrence depth must be an integer >= 1, got 0"):
        eng.prefill(["ab"], depth=0)
    with pytest.raises(ConfigError, match="--decode-depth"):
        eng.generate("ab", decode_depth=-1)
    with pytest.raises(ConfigError, match="--cache: unknown KV-cache mode 'full'"):
        eng.generate("ab", cache_mode="full")
    with pytest.raises(ConfigError, match="--max-new-tokens"):
        eng.generate("ab", max_new_tokens=0)
    with pytest.raises(ConfigError, match="--top-p"):
        eng.generate("ab", temperature=1.0, top_p=0.0)
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        eng.generate([3, 40])
    with pytest.raises(ConfigError, match="--depth"):
        make_engine(depth=0)
    with pytest.raises(ConfigError, match="no tokenizer"):
        make_engine(tokenizer=False).generate("ab")


def test_cache_copies_are_independent():
    eng = make_engine()
    st = eng.prefill(["abcd"], cache_mode="terminal")
    twin = clone_cache(st.cache)
    rows = select_rows(st.cache, [0, 0, 0])
    assert rows.batch_size == 3 and rows.get_seq_length() == 4 and rows.kv_bytes() == 3 * st.cache.kv_bytes()
    eng.decode(st, torch.tensor([5]))
    assert st.cache.get_seq_length() == 5 and twin.get_seq_length() == 4 and rows.get_seq_length() == 4
    # the copy continues exactly like the original would have
    st2 = eng.prefill(["abcd"], cache_mode="terminal")
    st2.cache = twin
    assert torch.allclose(eng.decode(st2, torch.tensor([5])), st.logits, atol=TOL)


def test_from_hf_folder_and_score_with_prefix(tmp_path):
    from megaloop.hf.load import is_hf_folder
    from megaloop.inference.engine import InferenceEngine

    eng = make_engine(depth=3)
    eng.model.save_pretrained(tmp_path / "hf")
    assert is_hf_folder(tmp_path / "hf") and not is_hf_folder(tmp_path)
    hf = InferenceEngine.load(tmp_path / "hf", prefill_depth=5)
    assert hf.tokenizer is None and hf.prefill_depth == 5 and hf.decode_depth == 3
    ids = torch.randint(2, 32, (2, 10), generator=torch.Generator().manual_seed(3))
    assert (hf.forward(ids) - eng.forward(ids)).abs().max() < TOL
    # per-visit cache at P == R: the two protocol passes give the parallel forward's logits
    last, chunk = hf.score_with_prefix(ids[:, :6], ids[:, 6:], depth=3, cache_mode="per_visit")
    full = hf.forward(ids, depth=3)
    assert (last - full[:, 5]).abs().max() < TOL and (chunk - full[:, 6:]).abs().max() < TOL
    _, chunk_t = hf.score_with_prefix(ids[:, :6], ids[:, 6:], depth=3, cache_mode="terminal")
    assert (chunk_t - full[:, 6:]).abs().max() > 1e-4
    from megaloop.train.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="not a megaloop HF folder"):
        InferenceEngine.from_hf(tmp_path)


def test_prompts_and_tokens_in_the_forms_a_notebook_passes():
    """prefill([5, 6, 7]) read three prompts (TypeError), numpy ids were not one prompt, decode took only a
    tensor (AttributeError for a list), an out-of-vocabulary decode token was an IndexError, stop=None a
    TypeError."""
    import numpy as np

    eng = make_engine(seed=6)
    one = eng.prefill([[5, 6, 7]])
    for form in ([5, 6, 7], torch.tensor([5, 6, 7]), np.array([5, 6, 7]), list(np.array([5, 6, 7]))):
        state = eng.prefill(form)
        assert state.batch_size == 1 and torch.equal(state.logits, one.logits)
    greedy = eng.generate([5, 6, 7], max_new_tokens=4, stop_at_eos=False).results[0].token_ids
    assert eng.generate(np.array([5, 6, 7]), max_new_tokens=4, stop_at_eos=False, stop=None).results[0].token_ids == greedy
    a, b = eng.prefill([5, 6, 7]), eng.prefill([5, 6, 7])
    assert torch.equal(eng.decode(a, [9]), eng.decode(b, 9))
    with pytest.raises(ConfigError, match=r"^decode: token ids \[5000\] outside the vocabulary \[0, 32\)"):
        eng.decode(eng.prefill([[5, 6, 7], [5, 6]]), torch.tensor([1, 5000]))
