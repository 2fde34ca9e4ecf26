"""A tokenizer.json re-saved by HF with padding/truncation settings: megaloop encodes raw ids and
still matches the data set's record (audit L: `eval ppl` refused a fine-tuned export's tokenizer, whose
file differed from the data's only by a `padding` block)."""

from __future__ import annotations

import json

from tokenizers import Tokenizer as HFTokenizer

from megaloop.data.synth import write_char_tokenizer
from megaloop.data.tokenizer import Tokenizer, file_sha256


def test_padding_and_truncation_of_a_resaved_file_are_off_and_its_content_digest_matches(tmp_path):
    orig = write_char_tokenizer(tmp_path / "orig")
    resaved = tmp_path / "resaved"
    resaved.mkdir()
    tk = HFTokenizer.from_file(str(orig))
    tk.enable_padding(length=64)
    tk.enable_truncation(max_length=8)
    tk.save(str(resaved / "tokenizer.json"))
    assert file_sha256(resaved / "tokenizer.json") != file_sha256(orig)
    assert json.loads((resaved / "tokenizer.json").read_text())["padding"] is not None

    plain, again = Tokenizer(orig), Tokenizer(resaved / "tokenizer.json")
    assert plain.sha256s == (file_sha256(orig),)
    assert file_sha256(orig) in again.sha256s  # the data set's record is accepted
    text = "a longer text than eight tokens"
    assert again._tok.encode(text).ids == plain._tok.encode(text).ids  # neither padded to 64 nor cut at 8


def test_the_eval_set_check_accepts_any_of_the_digests():
    import pytest

    from megaloop.config_utils import ConfigError
    from megaloop.eval.ppl import _check_tokenizer

    manifest = {"tokenizer_sha256": "a" * 64}
    _check_tokenizer("set", manifest, ("b" * 64, "a" * 64))
    _check_tokenizer("set", manifest, "a" * 64)
    with pytest.raises(ConfigError, match="tokenizer sha256 aaaaaaaaaaaa…, the checkpoint's tokenizer is bbbbbbbbbbbb…"):
        _check_tokenizer("set", manifest, ("b" * 64, "c" * 64))
