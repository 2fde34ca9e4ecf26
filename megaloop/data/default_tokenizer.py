"""The embedded corpus' tokenizer (cached) and the build-once cache helpers it shares.

``ensure_default_tokenizer`` trains, once per corpus fingerprint, a 4,096-token byte-level BPE on
a deterministic subsample of the embedded corpus (all prose, a content-hash share of the code) and
caches it as ``<cache>/default-tokenizer-<key>/``. It does not import ``megaloop.data.tokenizer``
(which resolves ``"default"`` through this module), so the two never import each other.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import uuid
from pathlib import Path
from typing import Callable

from megaloop.data._fsutil import atomic_write_json, file_lock, json_sha, rmtree_quiet

DEFAULT_VOCAB_SIZE = 4096  # the embedded corpus's byte-level BPE (the `tiny` preset's vocabulary)

TOKENIZER_VERSION = 2
# Share of each source's documents the BPE is trained on (by content hash): ~9 MB of text in all,
# a few seconds of training; the vocabulary sees prose, library code and test code.
BPE_SAMPLE = {"python-docs": 1.0, "python-code": 0.35, "python-tests": 0.15}


def cache_root(cache_dir: str | Path | None) -> Path:
    """``cache_dir`` or ``$MEGALOOP_CACHE`` or ``~/.cache/megaloop`` (created)."""
    from megaloop.data.streaming import default_cache_dir

    path = Path(cache_dir) if cache_dir else default_cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    return path


def build_once(final: Path, build: Callable[[Path], None], intact: Callable[[Path], bool] | None = None) -> Path:
    """Run ``build(tmp_dir)`` once per ``final`` across processes; publish by rename.

    ``final`` counts as built when it holds ``provenance.json`` (written last by ``build``) and
    ``intact(final)`` (when given) holds; one that fails it (a damaged or replaced file) is built again.
    Temporary folders of builds killed earlier are removed by the next build (they stayed for good).
    """
    def built() -> bool:
        return (final / "provenance.json").is_file() and (intact is None or intact(final))

    if built():
        return final
    with file_lock(final.parent / f".{final.name}.lock"):
        if built():
            return final
        host = socket.gethostname()
        for stale in final.parent.glob(f".{final.name}.tmp-{host}-*"):  # this host's, their process gone (a
            pid = stale.name[len(f".{final.name}.tmp-{host}-"):].split("-")[0]  # cache shared by hosts whose
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():  # flock is node-local keeps the others')
                rmtree_quiet(stale)
        tmp = final.parent / f".{final.name}.tmp-{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        try:
            build(tmp)
            rmtree_quiet(final)  # a half-built leftover (no provenance.json) from a crash
            os.rename(tmp, final)
        finally:
            rmtree_quiet(tmp)
    return final


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _in_sample(source: str, text: str) -> bool:
    share = BPE_SAMPLE.get(source, 0.0)
    digest = hashlib.blake2b(text.encode(), key=b"megaloop-bpe-sample", digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64 < share


def ensure_default_tokenizer(cache_dir: str | Path | None = None, vocab_size: int = DEFAULT_VOCAB_SIZE) -> Path:
    """Train (once, cached) the default byte-level BPE; returns its ``tokenizer.json`` path."""
    import tokenizers

    from megaloop.data.bpe import train_bytelevel_bpe
    from megaloop.data.stdlib_corpus import corpus_fingerprint, extract, platform_summary

    fingerprint = corpus_fingerprint()
    key = json_sha({"v": TOKENIZER_VERSION, "corpus": fingerprint, "vocab": vocab_size,
                    "sample": BPE_SAMPLE, "tokenizers": tokenizers.__version__})[:16]

    def build(tmp: Path) -> None:
        docs = [d for d in extract().documents if _in_sample(d.source, d.text)]
        train_bytelevel_bpe((d.text for d in docs), tmp, vocab_size=vocab_size)
        atomic_write_json(tmp / "provenance.json", {"tokenizer_sha256": _sha256(tmp / "tokenizer.json"),
            "corpus": "embedded Python corpus (megaloop.data.stdlib_corpus)",
            "corpus_sha256": fingerprint, "vocab_size": vocab_size, "sample_share": BPE_SAMPLE,
            "sample_documents": len(docs), "sample_chars": sum(len(d.text) for d in docs),
            "trainer": "tokenizers BpeTrainer (byte-level, min_frequency=2)",
            "tokenizers_version": tokenizers.__version__, **platform_summary()})

    def intact(final: Path) -> bool:  # a damaged or replaced tokenizer.json was used (and copied into runs)
        try:
            want = json.loads((final / "provenance.json").read_text()).get("tokenizer_sha256")
            if want is None:  # a cache built before the record: at least one that parses (a truncated one)
                return isinstance(json.loads((final / "tokenizer.json").read_text()), dict)
            return _sha256(final / "tokenizer.json") == want
        except (OSError, ValueError):
            return False

    return build_once(cache_root(cache_dir) / f"default-tokenizer-{key}", build, intact) / "tokenizer.json"
