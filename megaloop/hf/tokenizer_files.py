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


def check_embedded_corpus(run_cfg: dict, ckpt: Path, path: str) -> None:
    """A run on the embedded corpus that kept no tokenizer (runs before the copy) trained on *its*
    release's corpus, which a later release may have replaced with another of the same vocabulary
    size: such a checkpoint was scored, exported and generated with the new tokenizer, silently (an
    audit: PPL 2731.6 where its own tokenizer gives 692.4). Its loader state names the dataset it
    read; one that is not this release's embedded set is refused, naming ``--tokenizer``."""
    import torch

    from megaloop.data.loaders import resolve_data_path
    from megaloop.data.streaming import load_manifest

    try:
        common = torch.load(Path(ckpt) / "common.pt", map_location="cpu", weights_only=False)
        states = (common.get("common", common) or {}).get("loader") or []
        saved = states[0] if isinstance(states, list) and states and isinstance(states[0], dict) else {}
    except Exception:  # noqa: BLE001 - no loader state to compare (converted from HF, damaged): as before
        return
    seq = int((run_cfg.get("model") or {}).get("seq_len") or 0)
    if not seq or not (saved.get("dataset_fingerprint") or saved.get("num_samples")):
        return
    data = run_cfg.get("data") or {}
    manifest = load_manifest(resolve_data_path(path, seq, data.get("cache_dir"), "train"), data.get("cache_dir"))
    if saved.get("dataset_fingerprint") != manifest.get("fingerprint") and \
            saved.get("num_samples") != manifest.get("num_sequences"):  # a rebuild of the same set keeps its size
        from megaloop.hf.errors import ConversionError

        raise ConversionError(
            f"checkpoint {ckpt}: trained on an earlier release's embedded corpus ({saved.get('num_samples')} "
            f"sequences; this release's has {manifest.get('num_sequences')}) and its run kept no tokenizer.json: "
            "this release's embedded tokenizer is another one of the same size; pass --tokenizer with the "
            "tokenizer of the release it was trained with (its MEGALOOP_CACHE's default-tokenizer-*/tokenizer.json)")
