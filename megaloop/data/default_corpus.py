"""The embedded default dataset: Python's ``pydoc_data.topics`` through the real TxT360 path.

No download: the standard library ships ~465 KB of English reference text. It is split into
paragraph-group documents, written as a TxT360 tree (2 pseudo-sources x 3 duplicate buckets),
a byte-level BPE tokenizer is trained on it, and the tree is converted by the same code as
``data_prep/txt360_to_mds.py`` / ``build_eval_sets.py``. Result (``ensure_default_dataset``)::

    <cache>/default-<key>/
      corpus/data/pydoc-{a,b}/{1-1,2-5,6-10}/0_1.jsonl   TxT360-layout source text
      tokenizer/        tokenizer.json (+ HF tokenizer_config.json, special_tokens_map.json)
      train/ val/ screen/   MDS datasets, each with manifest.json
      provenance.json

``<cache>`` = ``cache_dir`` or ``$MEGALOOP_CACHE`` or ``~/.cache/megaloop``; ``<key>`` hashes the
corpus text, the settings and the library versions. Concurrent callers (all ranks of a job) are
safe: one builds under a file lock into a temp directory that is renamed into place; the others
wait and reuse it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

from megaloop.data._fsutil import atomic_write_json, file_lock, json_sha, rmtree_quiet

VERSION = 1
SOURCES = ("pydoc-a", "pydoc-b")
DOC_CHARS = 1200  # paragraphs are grouped into documents of at least this many characters


def _topics() -> dict[str, str]:
    from pydoc_data.topics import topics

    return dict(sorted(topics.items()))


def corpus_documents() -> list[dict]:
    """Documents ``{source, bucket, text, meta}`` of the embedded corpus (deterministic)."""
    docs = []
    for t_idx, (topic, text) in enumerate(_topics().items()):
        paras = [p.strip() for p in text.split("\n\n") if p.strip()]
        group: list[str] = []
        for i, p in enumerate(paras):
            group.append(p)
            if sum(map(len, group)) >= DOC_CHARS or i == len(paras) - 1:
                body = "\n\n".join(group)
                h = int(hashlib.sha256(body.encode()).hexdigest()[:8], 16) / 16**8
                bucket, dup = ("1-1", 1) if h < 0.6 else ("2-5", 3) if h < 0.9 else ("6-10", 8)
                docs.append({"source": SOURCES[t_idx % 2], "bucket": bucket, "text": body,
                             "meta": {"topic": topic, "part": len(group), "dup_count": dup,
                                      "origin": "pydoc_data.topics"}})
                group = []
    return docs


def write_corpus_tree(root: Path) -> int:
    """Write the corpus as ``root/data/<source>/<bucket>/0_1.jsonl``; returns the doc count."""
    docs = corpus_documents()
    files: dict[Path, list[str]] = {}
    for d in docs:
        path = root / "data" / d["source"] / d["bucket"] / "0_1.jsonl"
        files.setdefault(path, []).append(json.dumps({"text": d["text"], "meta": d["meta"]}))
    for path, lines in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")
    return len(docs)


def _corpus_sha() -> str:
    return hashlib.sha256(json.dumps(_topics(), sort_keys=True).encode()).hexdigest()


def _cache(cache_dir: str | Path | None) -> Path:
    from megaloop.data.streaming import default_cache_dir

    path = Path(cache_dir) if cache_dir else default_cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    return path


def _build_once(final: Path, build) -> Path:  # type: ignore[no-untyped-def]
    """Run ``build(tmp_dir)`` once per ``final`` across processes; publish by rename."""
    if (final / "provenance.json").is_file():
        return final
    with file_lock(final.parent / f".{final.name}.lock"):
        if (final / "provenance.json").is_file():
            return final
        tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        try:
            build(tmp)
            rmtree_quiet(final)  # a half-built leftover (no provenance.json) from a crash
            os.rename(tmp, final)
        finally:
            rmtree_quiet(tmp)
    return final


def ensure_default_tokenizer(cache_dir: str | Path | None = None, vocab_size: int = 4096) -> Path:
    """Train (once) the default byte-level BPE on the whole embedded corpus; path of its json."""
    import tokenizers

    from megaloop.data.tokenizer import train_bytelevel_bpe

    key = json_sha({"v": VERSION, "corpus": _corpus_sha(), "vocab": vocab_size,
                    "tokenizers": tokenizers.__version__})[:16]

    def build(tmp: Path) -> None:
        train_bytelevel_bpe((d["text"] for d in corpus_documents()), tmp, vocab_size=vocab_size)
        atomic_write_json(tmp / "provenance.json", {
            "corpus": "pydoc_data.topics", "corpus_sha256": _corpus_sha(), "vocab_size": vocab_size,
            "trainer": "tokenizers BpeTrainer (byte-level, min_frequency=2)",
            "tokenizers_version": tokenizers.__version__})

    return _build_once(_cache(cache_dir) / f"default-tokenizer-{key}", build) / "tokenizer.json"


def ensure_default_dataset(cache_dir: str | Path | None = None, seq_len: int = 256, *,
                           vocab_size: int = 4096, val_fraction: float = 0.1,
                           screen_fraction: float = 0.1, val_sequences_per_source: int = 32,
                           screen_seq_len: int | None = None, screen_sequences: int | None = None,
                           seed: int = 1234) -> Path:
    """Build (once, cached) the embedded dataset for ``seq_len``; returns its root directory.

    ``screen_seq_len`` defaults to ``seq_len``; ``screen_sequences`` to ``max(1, 8192 //
    screen_seq_len)`` (the corpus is far too small for the full 304 x 1,536 screen set).
    """
    import tokenizers

    from megaloop.data.eval_sets import EvalSetsConfig, build_eval_sets
    from megaloop.data.mds_convert import ConvertConfig, convert_txt360
    from megaloop.data.txt360 import HoldoutSpec, MixSpec

    screen_seq_len = screen_seq_len or seq_len
    screen_sequences = screen_sequences or max(1, 8192 // screen_seq_len)
    holdout = HoldoutSpec(val_fraction=val_fraction, screen_fraction=screen_fraction)
    settings = {"v": VERSION, "corpus": _corpus_sha(), "seq_len": seq_len, "vocab": vocab_size,
                "holdout": holdout.to_dict(), "val_per_source": val_sequences_per_source,
                "screen": [screen_sequences, screen_seq_len], "seed": seed,
                "tokenizers": tokenizers.__version__}
    cache = _cache(cache_dir)
    tok_json = ensure_default_tokenizer(cache, vocab_size)
    final = cache / f"default-{json_sha(settings)[:16]}"

    def build(tmp: Path) -> None:
        n_docs = write_corpus_tree(tmp / "corpus")
        shutil.copytree(tok_json.parent, tmp / "tokenizer")
        tok = str(tmp / "tokenizer" / "tokenizer.json")
        cmd = f"megaloop.data.default_corpus.ensure_default_dataset(seq_len={seq_len})"
        train = convert_txt360(ConvertConfig(
            input=tmp / "corpus", out=tmp / "train", tokenizer=tok, seq_len=seq_len, seed=seed,
            mix=MixSpec(), holdout=holdout, progress=False, command=cmd))
        evals = build_eval_sets(EvalSetsConfig(
            input=tmp / "corpus", out=tmp, tokenizer=tok, holdout=holdout, val_seq_len=seq_len,
            val_sequences_per_source=val_sequences_per_source, screen_seq_len=screen_seq_len,
            screen_sequences=screen_sequences, seed=seed, progress=False, command=cmd))
        for m in (tmp / "train" / "manifest.json", tmp / "val" / "manifest.json",
                  tmp / "screen" / "manifest.json"):  # record final, not temp, paths
            m.write_text(m.read_text().replace(str(tmp), str(final)))
        atomic_write_json(tmp / "provenance.json", {
            "corpus": "Python standard library pydoc_data.topics (CPython docs, PSF license)",
            "documents": n_docs, "settings": settings,
            "train": {k: train[k] for k in ("total_tokens", "num_sequences", "vocab_size")},
            "val": {k: evals["val"][k] for k in ("total_tokens", "num_sequences")},
            "screen": {k: evals["screen"][k] for k in ("total_tokens", "num_sequences")}})

    return _build_once(final, build)
