"""The embedded default dataset: the Python installation's own text through the real TxT360 path.

No download: every Python installation carries its standard library's sources and reference
documentation. ``megaloop.data.stdlib_corpus`` reads them as three TxT360 sources
(``python-code``, ``python-docs``, ``python-tests``), a byte-level BPE is trained on a subsample
(``megaloop.data.default_tokenizer``), and the tree is converted by the same code as
``data_prep/txt360_to_mds.py`` / ``build_eval_sets.py``. Cache layout (``<cache>`` =
``cache_dir`` or ``$MEGALOOP_CACHE`` or ``~/.cache/megaloop``)::

    <cache>/default-corpus-<key>/data/<source>/{1-1,2-5,6-10}/0_1.jsonl   TxT360 tree (+ provenance)
    <cache>/default-tokenizer-<key>/   tokenizer.json (+ HF tokenizer_config.json, ...)
    <cache>/default-<key>/             one per seq_len / settings:
      corpus/ (hard links to the tree)  tokenizer/  train/ val/ screen/ (MDS + manifest.json)
      provenance.json

Keys hash the corpus fingerprint (file list, sizes and bytes; Python version), the settings and
the library versions, so a second ``seq_len`` reuses the tree and the tokenizer. Concurrent
callers (all ranks of a job) are safe: one builds under a file lock into a temp directory that is
renamed into place; the others wait and reuse it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from megaloop.data._fsutil import atomic_write_json, json_sha
from megaloop.data.default_tokenizer import DEFAULT_VOCAB_SIZE, build_once, cache_root, ensure_default_tokenizer
from megaloop.data.stdlib_corpus import SOURCES, corpus_fingerprint, extract, platform_summary, \
    select
from megaloop.data.txt360 import HoldoutSpec

VERSION = 2
VAL_FRACTION = 0.1  # default holdout bands of the embedded corpus (shares of documents)
SCREEN_FRACTION = 0.1
__all__ = ["SOURCES", "corpus_documents", "ensure_corpus_tree", "ensure_default_dataset",
           "ensure_default_tokenizer", "write_corpus_tree"]


def _holdout(val_fraction: float = VAL_FRACTION,
             screen_fraction: float = SCREEN_FRACTION) -> HoldoutSpec:
    return HoldoutSpec(val_fraction=val_fraction, screen_fraction=screen_fraction)


def corpus_documents(holdout: HoldoutSpec | None = None) -> list[dict]:
    """Documents ``{source, bucket, text, meta}`` of the embedded corpus (deterministic order:
    the ``pydoc_data.topics`` documents first, then the standard library in path order)."""
    return [d.as_record() for d in select(extract(), holdout or _holdout())]


def write_corpus_tree(root: Path, holdout: HoldoutSpec | None = None) -> dict[str, dict]:
    """Write the corpus as ``root/data/<source>/<bucket>/0_1.jsonl``.

    Returns per-source ``{documents, chars, buckets: {bucket: documents}}``.
    """
    files: dict[Path, list[str]] = {}
    stats: dict[str, dict] = {s: {"documents": 0, "chars": 0, "buckets": {}} for s in SOURCES}
    for d in select(extract(), holdout or _holdout()):
        path = root / "data" / d.source / d.bucket / "0_1.jsonl"
        files.setdefault(path, []).append(json.dumps({"text": d.text, "meta": d.meta}))
        s = stats[d.source]
        s["documents"] += 1
        s["chars"] += len(d.text)
        s["buckets"][d.bucket] = s["buckets"].get(d.bucket, 0) + 1
    for path in sorted(files):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(files[path]) + "\n", encoding="utf-8")
    return {s: v | {"buckets": dict(sorted(v["buckets"].items()))} for s, v in stats.items()}


def ensure_corpus_tree(cache_dir: str | Path | None = None,
                       holdout: HoldoutSpec | None = None) -> Path:
    """Write (once, cached) the TxT360 tree of the embedded corpus; returns its root directory."""
    holdout = holdout or _holdout()
    fingerprint = corpus_fingerprint()
    key = json_sha({"v": VERSION, "corpus": fingerprint, "holdout": holdout.to_dict()})[:16]

    def build(tmp: Path) -> None:
        stats = write_corpus_tree(tmp, holdout)
        ex = extract()
        atomic_write_json(tmp / "provenance.json", {
            "corpus_sha256": fingerprint, "holdout": holdout.to_dict(), "sources": stats,
            "skipped_not_utf8": list(ex.skipped_undecodable),
            "code_files_not_parsed": list(ex.unparsed),
            "license": "Python Software Foundation License (CPython sources and documentation)",
            **platform_summary()})

    return build_once(cache_root(cache_dir) / f"default-corpus-{key}", build)


def _link_tree(src: Path, dst: Path) -> None:
    """Copy the JSONL files of ``src/data`` into ``dst/data`` as hard links (copies if refused)."""
    def link(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    shutil.copytree(src / "data", dst / "data", copy_function=link)


def ensure_default_dataset(cache_dir: str | Path | None = None, seq_len: int = 256, *,
                           vocab_size: int = DEFAULT_VOCAB_SIZE, val_fraction: float = VAL_FRACTION,
                           screen_fraction: float = SCREEN_FRACTION,
                           val_sequences_per_source: int | None = None,
                           screen_seq_len: int | None = None, screen_sequences: int | None = None,
                           seed: int = 1234) -> Path:
    """Build (once, cached) the embedded dataset for ``seq_len``; returns its root directory.

    ``val_sequences_per_source`` defaults to ``max(32, 8192 // seq_len)`` (>= 8k tokens per
    source), ``screen_seq_len`` to ``seq_len`` and ``screen_sequences`` to
    ``max(1, 8192 // screen_seq_len)`` (far smaller than the 304 x 1,536 screen set of TxT360).
    """
    import tokenizers

    from megaloop.data.eval_sets import EvalSetsConfig, build_eval_sets
    from megaloop.data.mds_convert import ConvertConfig, convert_txt360
    from megaloop.data.txt360 import MixSpec

    val_per_source = val_sequences_per_source or max(32, 8192 // seq_len)
    screen_seq_len = screen_seq_len or seq_len
    screen_sequences = screen_sequences or max(1, 8192 // screen_seq_len)
    holdout = _holdout(val_fraction, screen_fraction)
    fingerprint = corpus_fingerprint()
    settings = {"v": VERSION, "corpus": fingerprint, "seq_len": seq_len, "vocab": vocab_size,
                "holdout": holdout.to_dict(), "val_per_source": val_per_source,
                "screen": [screen_sequences, screen_seq_len], "seed": seed,
                "tokenizers": tokenizers.__version__}
    cache = cache_root(cache_dir)
    tree = ensure_corpus_tree(cache, holdout)
    tok_json = ensure_default_tokenizer(cache, vocab_size)
    final = cache / f"default-{json_sha(settings)[:16]}"

    def build(tmp: Path) -> None:
        _link_tree(tree, tmp / "corpus")
        shutil.copytree(tok_json.parent, tmp / "tokenizer")
        tok = str(tmp / "tokenizer" / "tokenizer.json")
        cmd = f"megaloop.data.default_corpus.ensure_default_dataset(seq_len={seq_len})"
        train = convert_txt360(ConvertConfig(
            input=tmp / "corpus", out=tmp / "train", tokenizer=tok, seq_len=seq_len, seed=seed,
            mix=MixSpec(), holdout=holdout, progress=False, command=cmd))
        evals = build_eval_sets(EvalSetsConfig(
            input=tmp / "corpus", out=tmp, tokenizer=tok, holdout=holdout, val_seq_len=seq_len,
            val_sequences_per_source=val_per_source, screen_seq_len=screen_seq_len,
            screen_sequences=screen_sequences, seed=seed, progress=False, command=cmd))
        for m in (tmp / "train" / "manifest.json", tmp / "val" / "manifest.json",
                  tmp / "screen" / "manifest.json"):  # record final, not temp, paths
            m.write_text(m.read_text().replace(str(tmp), str(final)))
        corpus = json.loads((tree / "provenance.json").read_text())
        per_source = {}
        for s in SOURCES:
            t, c = train["sources"].get(s, {}), corpus["sources"][s]
            per_source[s] = {
                "documents": c["documents"], "chars": c["chars"],
                "train_documents": t.get("docs", 0), "val_documents": t.get("docs_val", 0),
                "screen_documents": t.get("docs_screen", 0),
                "train_unique_tokens": t.get("raw_tokens", 0),
                "train_tokens": t.get("packed_tokens", 0),
                "val_sequences": evals["val"]["sources"].get(s, {}).get("num_sequences", 0),
                "screen_sequences": evals["screen"]["sequences_by_source"].get(s, 0)}
        atomic_write_json(tmp / "provenance.json", {
            "corpus": "Python standard library sources, docstrings and pydoc_data.topics "
                      "(CPython, PSF license)",
            "corpus_sha256": fingerprint, "settings": settings, "sources": per_source,
            "skipped_not_utf8": corpus["skipped_not_utf8"], **platform_summary(),
            "train": {k: train[k] for k in ("total_tokens", "num_sequences", "vocab_size")}
            | {"unique_tokens": sum(v["train_unique_tokens"] for v in per_source.values())},
            "val": {k: evals["val"][k] for k in ("total_tokens", "num_sequences")},
            "screen": {k: evals["screen"][k] for k in ("total_tokens", "num_sequences")}})

    return build_once(final, build)
