"""Token-by-token (decode) scoring of the lm-eval adapter vs a manual decode loop through the cache,
on a small random looped model (no checkpoint needed): both cache modes, separate prefill / decode
depths, batches mixing contexts of different lengths; parallel mode; rolling and generation."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megaloop.config_utils import ConfigError
from megaloop.eval.decode_score import decode_loglikelihood, parallel_loglikelihood
from megaloop.eval.harness import MegaloopLM
from tests.inference.helpers import make_engine

REQUESTS = [("the cat sat", " on the mat"), ("the cat sat", " down"), ("the cat sat", " x"),
            ("a dog", " barked at the moon!"), ("hello", " world, again and again"), ("", "begin")]


def _req(*args):
    return SimpleNamespace(args=args)


@pytest.fixture(scope="module")
def engine():
    return make_engine(seed=7, depth=3)


def manual_decode(engine, ctx: list[int], cont: list[int], mode: str, pdepth: int, ddepth: int) -> float:
    """Prefill ``ctx`` alone at ``pdepth``, then feed ``cont`` one token per forward at ``ddepth``."""
    model, v = engine.model, engine.vocab_size
    cache = model.new_cache(mode)
    total = 0.0
    with torch.no_grad():
        logits = model(torch.tensor([ctx]), past_key_values=cache, use_cache=True, num_recurrences=pdepth).logits
        for tok in cont:
            total += torch.log_softmax(logits[0, -1, :v].float(), -1)[tok].item()
            logits = model(torch.tensor([[tok]]), past_key_values=cache, use_cache=True,
                           num_recurrences=ddepth).logits
    return total


@pytest.mark.parametrize("mode", ["terminal", "per_visit"])
@pytest.mark.parametrize("batch_size", [1, 4, 16])
def test_decode_scoring_equals_a_manual_decode_loop(engine, mode, batch_size):
    lm = MegaloopLM(engine, cache_mode=mode, prefill_depth=4, decode_depth=2, batch_size=batch_size)
    assert lm.scoring == "decode"  # the default
    got = lm.loglikelihood([_req(*r) for r in REQUESTS])
    for (context, continuation), (lp, greedy) in zip(REQUESTS, got):
        ctx, cont = lm._encode_pair(context, continuation)
        assert lp == pytest.approx(manual_decode(engine, ctx, cont, mode, 4, 2), abs=1e-5)
        assert isinstance(greedy, bool)


def test_decode_and_parallel_scoring_differ_and_depths_matter(engine):
    pairs = [(engine.encode("the cat sat"), engine.encode(" on the mat"))]
    dec = decode_loglikelihood(engine, pairs, prefill_depth=3, decode_depth=3, cache_mode="terminal")[0][0]
    par = parallel_loglikelihood(engine, pairs, depth=3, prefill_depth=3, cache_mode="terminal")[0][0]
    # continuation tokens read each other through terminal banks (decode) vs depth-matched (parallel)
    assert abs(dec - par) > 1e-4
    deeper = decode_loglikelihood(engine, pairs, prefill_depth=3, decode_depth=5, cache_mode="terminal")[0][0]
    assert abs(deeper - dec) > 1e-4  # --decode-depth changes loglikelihood scores
    # with the full per-visit cache and P = D = R, decoding equals the plain parallel forward
    full = parallel_loglikelihood(engine, pairs, depth=3, prefill_depth=3, cache_mode="none")[0][0]
    per_visit = decode_loglikelihood(engine, pairs, prefill_depth=3, decode_depth=3, cache_mode="per_visit")[0][0]
    assert per_visit == pytest.approx(full, abs=1e-5)
    # the first continuation token comes from the prefill alone: same in every mode
    one = [(pairs[0][0], pairs[0][1][:1])]
    assert decode_loglikelihood(engine, one, prefill_depth=3, decode_depth=5)[0][0] == pytest.approx(
        parallel_loglikelihood(engine, one, depth=3, prefill_depth=3)[0][0], abs=1e-6)


def test_parallel_option_and_greedy_flag(engine):
    lm = MegaloopLM(engine, cache_mode="terminal", scoring="parallel", prefill_depth=4)
    ctx, cont = engine.encode("hello"), engine.encode(" world")
    expected = parallel_loglikelihood(engine, [(ctx, cont)], depth=lm.depth, prefill_depth=4)[0]
    assert lm.loglikelihood([_req("hello", " world")])[0] == pytest.approx(expected)
    assert MegaloopLM(engine, cache_mode="none").scoring == "parallel"
    # a continuation made of the greedy tokens is flagged greedy
    state = engine.prefill([ctx], depth=4, decode_depth=2)
    toks = []
    for _ in range(3):
        toks.append(int(state.logits.argmax(-1)))
        engine.decode(state, torch.tensor(toks[-1:]))
    lp, greedy = decode_loglikelihood(engine, [(ctx, toks)], prefill_depth=4, decode_depth=2)[0]
    assert greedy and lp < 0


def test_rolling_and_generation_honour_prefill_and_decode_depths(engine):
    lm = MegaloopLM(engine, cache_mode="terminal", prefill_depth=4, decode_depth=2)
    text = "the quick brown fox jumps"
    roll = lm.loglikelihood_rolling([_req(text), _req("ab")])
    assert roll[0] == pytest.approx(manual_decode(engine, [engine.eos_id], engine.encode(text), "terminal", 4, 2),
                                    abs=1e-5)
    assert roll[1] == pytest.approx(lm.loglikelihood([_req("", "ab")])[0][0], abs=1e-6)
    out = lm.generate_until([_req("the cat", {"until": ["!"], "max_gen_toks": 6})])[0]
    ref = engine.generate("the cat", max_new_tokens=6, stop=["!"], prefill_depth=4, decode_depth=2).results[0].text
    assert out == ref


def test_bad_scoring_arguments(engine):
    with pytest.raises(ConfigError, match="--scoring: one of"):
        MegaloopLM(engine, scoring="beam")
    with pytest.raises(ConfigError, match="--scoring decode: token-by-token decoding needs a KV cache"):
        MegaloopLM(engine, cache_mode="none", scoring="decode")
    with pytest.raises(ConfigError, match="--decode-depth"):
        MegaloopLM(engine, decode_depth=0)
    with pytest.raises(ConfigError, match="--batch-size"):
        decode_loglikelihood(engine, [([2], [3])], prefill_depth=1, decode_depth=1, batch_size=0)


def test_unknown_model_args_are_refused_and_lm_evals_extras_accepted(engine):
    """lm-eval passes batch_size, max_batch_size and device with the user's model_args; a
    misspelled key (``cache=``) is named instead of being dropped."""
    assert MegaloopLM(engine, batch_size=4, max_batch_size=64, device="cpu").batch_size == 4
    with pytest.raises(ConfigError, match=r"unknown model_args cache, scoringg \(known: checkpoint, hf, depth"):
        MegaloopLM(engine, cache="per_visit", scoringg="decode")
