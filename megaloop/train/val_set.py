"""The checks a validation set (``data.val_path``) gets against the training data before a run starts.

* another tokenizer than the training data's: refused (its CE would score other token ids);
* sequences longer than ``model.seq_len``, or an FP8 shape that does not tile: refused;
* the training set itself, or another set built as training data (``kind: train``) or from other
  content-hash holdout bands than the training shards (``holdout``): its documents may also be in
  the training shards, so validation would score training data. The same path as ``data.path``
  is refused; the others are warned about (a set of another corpus is fine, and the manifests do
  not say which corpus they came from).
"""

from __future__ import annotations

from pathlib import Path

from megaloop.config_utils import ConfigError


def check_val_manifest(path: str, manifest: dict, train_path: str, train_manifest: dict, *, seq_len: int,
                       micro_batch_size: int, fp8: bool) -> tuple[int, list[str]]:
    """``(sequence length of the set, warnings)`` for validation set ``path`` (its ``manifest``) beside
    the training set ``train_path`` (``train_manifest``); raises :class:`ConfigError` naming
    ``data.val_path`` for a set that cannot be used. ``seq_len``: ``model.seq_len``."""
    from megaloop.data.tokenizer import manifest_eos_id, manifest_tokenizer_sha256

    seq = int(manifest.get("seq_len") or seq_len)
    have, want = manifest_tokenizer_sha256(manifest), manifest_tokenizer_sha256(train_manifest)
    if have and want and have != want:
        raise ConfigError(f"data.val_path: {path} was tokenised with tokenizer sha256 {have[:12]}…, the "
                          f"training data ({train_path}) with {want[:12]}… (rebuild the validation "
                          "set with the training data's tokenizer)")
    eos, train_eos = manifest_eos_id(manifest), manifest_eos_id(train_manifest)
    if eos is not None and train_eos is not None and eos != train_eos:  # same tokenizer, another --eos-token
        raise ConfigError(f"data.val_path: {path} ends its documents with EOS id {eos}, the training data "
                          f"({train_path}) with {train_eos} (rebuild the validation set with the training data's "
                          "--eos-token)")
    if seq > seq_len:
        raise ConfigError(f"data.val_path: {path} holds {seq}-token sequences, longer than model.seq_len={seq_len}")
    if fp8 and (seq * micro_batch_size) % 16:
        raise ConfigError(f"data.val_path: {path} holds {seq}-token sequences; with model.fp8, "
                          f"seq x micro_batch_size {micro_batch_size} must be a multiple of 16")
    if _same_folder(path, train_path):
        raise ConfigError(f"data.val_path: {path} is data.path, the training set: validation would score the "
                          "training data; build held-out sets with data_prep/build_eval_sets.py")
    warnings = []
    if manifest.get("kind") == "train":
        warnings.append(f"data.val_path: {path} was built as training data (manifest kind: train), not as a "
                        "held-out set; if it shares a corpus with data.path, validation scores training data "
                        "(data_prep/build_eval_sets.py builds the held-out sets)")
    elif isinstance(manifest.get("holdout"), dict) and isinstance(train_manifest.get("holdout"), dict) \
            and manifest["holdout"] != train_manifest["holdout"]:
        warnings.append(f"data.val_path: {path} was held out with {manifest['holdout']}, the training shards "
                        f"({train_path}) with {train_manifest['holdout']}: if both come from one corpus, "
                        "documents of the validation set are also in the training shards (build both with "
                        "the same holdout spec)")
    return seq, warnings


def _same_folder(a: str, b: str) -> bool:
    """Both local paths naming one folder (a remote or missing one: False)."""
    if "://" in a or "://" in b:
        return a.rstrip("/") == b.rstrip("/")
    try:
        return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()
    except OSError:
        return False


def mixval_plan(val_path: str, seq_len: int, cache_dir: str | None, k: int) -> tuple[list[int], list[str], list[int]]:
    """MixVal order of validation set ``val_path``: the global sample indices to evaluate, the sorted
    source names and each index's source id. Sources are interleaved round-robin (each source's
    samples in file order), and the first ``k`` (``train.eval_batches × global_batch_size``) of that
    order are evaluated (0, or a set smaller than that: the whole set) — the same sequences at every
    TP/PP/DP layout and micro-batch size."""
    from megaloop.data.loaders import read_sources, source_balanced_order

    sources = read_sources(val_path, seq_len=seq_len, cache_dir=cache_dir, hashes_verified=True)  # by the trainer
    names = sorted(set(sources))
    order = source_balanced_order(sources)
    order = order[:k] if k > 0 else order
    return order, names, [names.index(sources[i]) for i in order]


def read_val_batches(loader, val_path: str) -> None:
    """Read every batch of ``loader`` once and close it: what cannot be read (a bad token id, a sample
    that does not decode) is a :class:`DataError` naming ``data.val_path`` at set-up, not at the first
    evaluation after some training steps."""
    from megaloop.data.errors import DataError

    try:
        for _ in loader:
            pass
    except DataError as err:
        raise DataError(f"data.val_path={val_path}: {err}") from None
    finally:
        loader.close()
