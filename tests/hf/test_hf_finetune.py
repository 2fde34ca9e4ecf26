"""The export under HF fine-tuning tools: a PEFT LoRA adapter on the scaled embedding merges into the
model it trained, and tokens added with ``resize_token_embeddings`` count as tokens (not padding), in
the folder and when megaloop loads one saved before this release."""

from __future__ import annotations

import json

import pytest
import torch

from megaloop.hf import MegaloopConfig, MegaloopForCausalLM

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _model(vocab=64, **kw) -> MegaloopForCausalLM:
    torch.manual_seed(0)
    cfg = MegaloopConfig(vocab_size=vocab, hidden_size=64, num_attention_heads=4, n_prelude=1, n_core=1, n_coda=1,
                         num_hidden_layers=3, injection="parcae_nonorm", num_recurrences=2, **kw)
    return MegaloopForCausalLM(cfg).float().eval()


def test_lora_on_the_scaled_embedding_merges_into_the_trained_model():
    """PEFT scales a LoRA embedding's output only for a layer with ``embed_scale``: ours was named
    ``multiplier``, so the merged model (adapter inside the scaled weight) differed by logits of ~5."""
    import peft  # the test extra installs it
    model = _model(embedding_multiplier=8.0)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["embed_tokens"], init_lora_weights=False))
    ids = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        adapted = lora(ids).logits
        merged = lora.merge_and_unload()(ids).logits
        plain = _model(embedding_multiplier=8.0)(ids).logits
    assert (adapted - plain).abs().max() > 1e-2  # the adapter does something
    torch.testing.assert_close(merged, adapted, atol=1e-4, rtol=1e-4)


def test_resized_tokens_are_tokens(tmp_path):
    """``resize_token_embeddings`` left ``tokenizer_vocab_size`` at the old size: the added token was
    padding to generation (never emitted) and to megaloop (suppressed, and a re-export dropped it)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from megaloop.hf.load import load_model

    model = _model(tokenizer_vocab_size=60)
    model.generation_config.suppress_tokens = list(range(60, 64))  # as an export writes it
    model.resize_token_embeddings(62, pad_to_multiple_of=8)
    assert (model.config.vocab_size, model.config.tokenizer_vocab_size) == (64, 62)
    assert model.generation_config.suppress_tokens == [62, 63]  # still [60..63]: never generated

    def favour_60(module, inputs, out):
        out[..., 60] += 100.0
        return out

    hook = model.lm_head.register_forward_hook(favour_60)
    new = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, do_sample=False)[0, 3:].tolist()
    hook.remove()
    assert new == [60, 60, 60], new
    model = _model()
    model.resize_token_embeddings(65)
    assert (model.config.vocab_size, model.config.tokenizer_vocab_size) == (65, 65)
    assert _model().resize_token_embeddings(70, pad_to_multiple_of=8) is not None
    padded = _model()  # no suppress list yet (the tokenizer filled every row): the new padding rows get one
    padded.resize_token_embeddings(70, pad_to_multiple_of=8)
    assert padded.generation_config.suppress_tokens == [70, 71]
    model.resize_token_embeddings(70, pad_to_multiple_of=8)  # padded rows stay padding
    assert (model.config.vocab_size, model.config.tokenizer_vocab_size) == (72, 70)
    # a folder saved before this release: the field still says 64, its tokenizer holds 70 tokens
    model.config.tokenizer_vocab_size = 64
    model.save_pretrained(tmp_path)
    Tokenizer(WordLevel({f"t{i}": i for i in range(70)}, unk_token="t0")).save(str(tmp_path / "tokenizer.json"))
    assert json.loads((tmp_path / "config.json").read_text())["tokenizer_vocab_size"] == 64
    assert load_model(tmp_path, kind="hf").model.config.tokenizer_vocab_size == 70
    Tokenizer(WordLevel({f"t{i}": i for i in range(80)}, unk_token="t0")).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(Exception, match="80 tokens, more than the model's 72 embedding rows"):
        load_model(tmp_path, kind="hf")
