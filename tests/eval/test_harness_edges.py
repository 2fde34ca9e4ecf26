"""lm-eval requests at the edges of the context window, and the HF export as lm-eval's own HF model
reads it: nothing is cut or generated silently, and both backends condition on the same token."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from megaloop.config_utils import ConfigError
from megaloop.eval.harness import MegaloopLM


def _req(*args):
    return SimpleNamespace(args=args)


def test_generate_until_refuses_lengths_that_leave_no_prompt(trained_engine):
    lm = MegaloopLM(trained_engine, cache_mode="terminal")
    window = lm.max_length  # 128: the training seq_len
    # max_gen_toks 0 generated one token anyway
    with pytest.raises(ConfigError, match=r"max_gen_toks must be >= 1, got 0"):
        lm.generate_until([_req("def f(x):", {"until": ["\n"], "max_gen_toks": 0})])
    # a max_gen_toks at the window cut every prompt to its last token, silently
    with pytest.raises(ConfigError, match=rf"max_gen_toks {window} leaves no room .* {window} tokens"):
        lm.generate_until([_req("def f(x):", {"until": ["\n"], "max_gen_toks": window})])


def test_generate_until_cuts_a_long_prompt_to_leave_room_and_says_so(trained_engine, monkeypatch, capsys):
    lm = MegaloopLM(trained_engine, cache_mode="terminal")
    fed = []
    real = trained_engine.generate

    def spy(ids, **kw):
        fed.append(list(ids))
        return real(ids, **kw)

    monkeypatch.setattr(trained_engine, "generate", spy)
    words = " ".join(["class"] * 200)  # longer than the window
    n_new = 8
    out = lm.generate_until([_req(words, {"until": ["\n"], "max_gen_toks": n_new}),
                             _req(words, {"until": ["\n"], "max_gen_toks": n_new}),
                             _req("def f(x):", {"until": ["\n"], "max_gen_toks": n_new})])
    assert len(out) == 3 and all(isinstance(t, str) for t in out)
    assert [len(f) for f in fed[:2]] == [lm.max_length - n_new] * 2  # room for max_gen_toks, as lm-eval's HF model
    assert fed[2] == trained_engine.encode("def f(x):")  # a short prompt is untouched
    assert fed[0] == trained_engine.encode(words)[-(lm.max_length - n_new):]
    err = capsys.readouterr().err
    assert err.count("is cut on the left") == 1 and lm._cut_prompts == 2  # said once, counted per prompt
    assert not lm.rope_extrapolated


def test_long_continuation_is_refused_not_scored_by_its_tail(trained_engine):
    lm = MegaloopLM(trained_engine, cache_mode="none")
    long = " ".join(["return"] * 300)
    with pytest.raises(ConfigError, match=r"continuation of \d+ tokens does not fit the context window of 128"):
        lm.loglikelihood([_req("x =", " " + long)])
    # a continuation that fits keeps every token (context cut on the left instead)
    ctx, cont = lm._truncate(list(range(3, 200)), list(range(3, 100)))
    assert len(cont) == 97 and len(ctx) + len(cont) - 1 == lm.max_length


def test_requests_past_the_training_length_warn_once(trained_engine, monkeypatch, capsys):
    monkeypatch.setattr(trained_engine, "max_context", 512)  # --max-context 512 on a 128-token model
    lm = MegaloopLM(trained_engine, cache_mode="none")
    text = " ".join(["class"] * 180)
    lm.loglikelihood_rolling([_req(text), _req(text)])
    err = capsys.readouterr().err
    assert err.count("beyond the training seq_len 128") == 1 and lm.rope_extrapolated
    short = MegaloopLM(trained_engine, cache_mode="none")
    short.loglikelihood_rolling([_req("def f(x):")])
    assert "beyond the training" not in capsys.readouterr().err and not short.rope_extrapolated


def test_generate_exit_with_no_decode_step_writes_its_json(cli, trained_run, tmp_path):
    """Every row stopping at the prefill's token (--max-new-tokens 1) under --exit was a TypeError
    after the text printed, and --json was not written."""
    out = tmp_path / "one.json"
    code, err = cli("generate", "--checkpoint", str(trained_run), "--prompt", "hello", "--max-new-tokens", "1",
                    "--exit", "latent:1e-3", "--json", str(out))
    assert code == 0, err
    res = json.loads(out.read_text())
    assert res["stats"]["mean_depth"] is None and res["stats"]["decode_tokens"] == 0
    assert len(res["results"][0]["token_ids"]) <= 1


def test_lm_eval_hf_model_on_the_export_conditions_as_megaloop_does(megatron_world, trained_run, trained_engine,
                                                                    tmp_path):
    """The export declared the tokenizer's unused <|bos|> as BOS: lm-eval's HF model prefixes requests
    with the BOS, which training never saw (documents are EOS-separated), and rolling / empty-context
    scores differed from `eval harness` by 1.4-2 nats per document."""
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer

    from megaloop.hf.convert import convert_to_hf

    out = tmp_path / "hf"
    convert_to_hf(trained_run, out)
    tok = AutoTokenizer.from_pretrained(str(out))
    cfg = json.loads((out / "config.json").read_text())
    eos = trained_engine.eos_id
    assert tok.bos_token_id == tok.eos_token_id == eos and cfg["bos_token_id"] == eos
    from megaloop.data.tokenizer import Tokenizer  # the copying probe leaves out the same special ids on both

    assert Tokenizer(out / "tokenizer.json").special_ids == trained_engine.tokenizer.special_ids == {0, 1, 2}
    hf = HFLM(pretrained=str(out), trust_remote_code=True, dtype="float32", device="cpu", batch_size=2)
    ours = MegaloopLM(trained_engine, cache_mode="none")
    text = "The for statement is used to iterate over the elements of a sequence."
    reqs = [_req(text), _req("Classes provide a means of bundling data and functionality together.")]
    for a, b in zip(hf.loglikelihood_rolling(reqs), ours.loglikelihood_rolling(reqs)):
        assert math.isfinite(a) and a == pytest.approx(b, abs=1e-3)
    (a, _), = hf.loglikelihood([_req("", "hello world")])
    (b, _), = ours.loglikelihood([_req("", "hello world")])
    assert a == pytest.approx(b, abs=1e-3)
