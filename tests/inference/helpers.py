"""Small HF looped models and a character tokenizer for engine / fixed-point tests (no megatron)."""

from __future__ import annotations

import torch

from megaloop.hf import MegaloopConfig, MegaloopForCausalLM

ALPHABET = "#abcdefghijklmnopqrstuvwxyz .,!?"  # id 0 ('#') is EOS


class CharTokenizer:
    """One id per character of ALPHABET (ids 0..31); EOS = 0, pad = 1."""

    eos_id, pad_id, bos_id = 0, 1, None
    vocab_size = len(ALPHABET)

    def encode(self, text: str) -> list[int]:
        return [ALPHABET.index(c) for c in text]

    def decode(self, ids) -> str:
        return "".join(ALPHABET[int(i)] for i in ids)


def make_model(injection: str = "parcae_decay", seed: int = 0, vocab: int = 48, real_vocab: int = 32,
               scale: float = 0.1, **kw) -> MegaloopForCausalLM:
    """Looped 1/2/1 model, hidden 32, GQA 4/2 heads, perturbed random weights, FP32, eval mode.
    ``vocab`` rows (padded), ``real_vocab`` tokenizer ids."""
    cfg = dict(vocab_size=vocab, tokenizer_vocab_size=real_vocab, hidden_size=32, num_attention_heads=4,
               num_key_value_heads=2, n_prelude=1, n_core=2, n_coda=1, injection=injection, state_init_std=0.5,
               eval_seed=3, num_recurrences=3, max_position_embeddings=64, eos_token_id=0, pad_token_id=1)
    cfg.update(kw)
    torch.manual_seed(seed)
    model = MegaloopForCausalLM(MegaloopConfig(**cfg))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return model.float().eval()


def make_engine(seed: int = 0, tokenizer=True, **kw):
    from megaloop.inference.engine import InferenceEngine

    engine_kw = {k: kw.pop(k) for k in ("depth", "prefill_depth", "decode_depth", "cache_mode", "max_context")
                 if k in kw}
    return InferenceEngine(make_model(seed=seed, **kw), CharTokenizer() if tokenizer else None, **engine_kw)
