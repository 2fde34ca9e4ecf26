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


def check_embedded_corpus(run_cfg: dict, ckpt: Path, path: str) -> Path | None:
    """A run on the embedded corpus that kept no tokenizer (runs before the copy) trained on *its*
    release's corpus, which a later release may have replaced with another of the same vocabulary
    size: such a checkpoint was scored, exported and generated with the new tokenizer, silently (an
    audit: PPL 2731.6 where its own tokenizer gives 692.4). Its loader state names the dataset it read:
    an embedded set of that fingerprint still in the cache gives its own tokenizer (returned);
    otherwise one that is not this release's set (built for the check if needed, in the run's cache,
    else ``$MEGALOOP_CACHE``) is refused, naming ``--tokenizer``. None: use this release's tokenizer."""
    from megaloop.data.config import embedded_split
    from megaloop.data.dataset_checks import default_cache_dir
    from megaloop.data.loaders import resolve_data_path
    from megaloop.data.streaming import load_manifest
    from megaloop.data.tokenizer import read_manifest, verified_manifest_tokenizer
    from megaloop.errors import UserError

    if embedded_split(path, "train") is None:  # a folder whose name starts with "default"
        return None
    from megatron.core import dist_checkpointing  # the reader every other caller of common.pt uses

    try:
        states = (dist_checkpointing.load_common_state_dict(str(ckpt)).get("common") or {}).get("loader") or []
    except Exception:  # noqa: BLE001 - unreadable: nothing to compare (the load itself names the damage)
        return None
    saved = states[0] if isinstance(states, list) and states and isinstance(states[0], dict) else {}
    seq = int((run_cfg.get("model") or {}).get("seq_len") or 0)
    if not seq or not saved.get("dataset_fingerprint"):
        return None
    data = run_cfg.get("data") or {}
    roots = list(dict.fromkeys(Path(c) for c in (data.get("cache_dir"), default_cache_dir()) if c))
    for root in roots:  # the set it read, if still cached (an earlier release's too): its own tokenizer
        for man in sorted(root.glob("default-*/train/manifest.json")):
            if (read_manifest(man.parent) or {}).get("fingerprint") == saved["dataset_fingerprint"]:
                found, _ = verified_manifest_tokenizer(man.parent)
                if found is not None:
                    return found
    manifest = None
    for root in roots:
        try:
            manifest = load_manifest(resolve_data_path(path, seq, str(root), "train"), str(root))
            break
        except (UserError, OSError):  # an old cache_dir that is gone or unusable now: the next
            continue
    if manifest is None or saved["dataset_fingerprint"] == manifest.get("fingerprint") or \
            saved.get("num_samples") == manifest.get("num_sequences"):  # a rebuild of the same set keeps its size
        return None
    from megaloop.hf.errors import ConversionError

    raise ConversionError(
        f"checkpoint {ckpt}: trained on an embedded corpus other than this installation's ({saved.get('num_samples')} "
        f"sequences; this one's has {manifest.get('num_sequences')}: an earlier release's, or another Python's) and "
        "its run kept no tokenizer.json: this embedded tokenizer is another one of the same size; pass --tokenizer "
        "with the tokenizer it was trained with (that cache's default-tokenizer-*/tokenizer.json)")
