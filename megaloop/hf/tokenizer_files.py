"""The tokenizer files of an exported HF folder: a run's bare ``tokenizer.json`` wrapped in a
``PreTrainedTokenizerFast`` (eos/bos/pad, left padding) so ``AutoTokenizer`` loads it (``megaloop
convert`` and ``megaloop rl``'s HF folders)."""

from __future__ import annotations

from pathlib import Path


def tokenizer_info(path: Path) -> dict:
    """``{vocab_size, eos, bos, pad}`` of a tokenizer file (ids or None)."""
    from megaloop.data.tokenizer import Tokenizer

    tok = Tokenizer(path)
    return {"vocab_size": tok.vocab_size, "eos": tok.eos_id, "bos": tok.bos_id, "pad": tok.pad_id}


def save_tokenizer(path: Path, out: Path, info: dict, max_len: int) -> None:
    """Wrap ``tokenizer.json`` in a PreTrainedTokenizerFast with eos/bos/pad and save it."""
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer.from_file(str(path))
    name = lambda i: raw.id_to_token(i) if i is not None else None  # noqa: E731
    eos, bos = name(info["eos"]), name(info["bos"])
    pad = name(info["pad"]) or eos
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=eos, bos_token=bos, pad_token=pad,
                                  model_max_length=max_len, padding_side="left",  # batched generate pads left
                                  model_input_names=["input_ids", "attention_mask"])  # no token_type_ids
    tok.save_pretrained(str(out))
