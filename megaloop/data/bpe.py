"""Deterministic byte-level BPE training (HF ``tokenizers``), writing an HF-loadable directory.

A leaf module (no other megaloop imports) so both the tokenizer loader and the embedded-corpus
builder can use it without importing each other.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

# Special tokens of tokenizers trained by megaloop (ids 0, 1, 2 in this order).
SPECIAL_TOKENS = ("<|endoftext|>", "<|bos|>", "<|pad|>")


def train_bytelevel_bpe(texts: Iterable[str], out_dir: str | Path, vocab_size: int = 4096,
                        min_frequency: int = 2) -> Path:
    """Train a deterministic byte-level BPE on ``texts``; write an HF-loadable tokenizer dir.

    Writes ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` so both
    ``load_tokenizer`` and ``transformers.PreTrainedTokenizerFast.from_pretrained(out_dir)`` work.
    Special tokens: ``<|endoftext|>`` (EOS, id 0), ``<|bos|>`` (1), ``<|pad|>`` (2).
    Returns the path of ``tokenizer.json``.
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    eos, bos, pad = SPECIAL_TOKENS
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": eos, "bos_token": bos, "pad_token": pad, "unk_token": eos}, indent=2))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "bos_token": bos,
        "pad_token": pad, "unk_token": eos, "model_max_length": 1_000_000,
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
    }, indent=2))
    return out / "tokenizer.json"
