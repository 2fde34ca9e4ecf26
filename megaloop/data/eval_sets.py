"""Held-out validation set (MixVal-style, per source) and the frozen LR-screen set.

Provenance: both sets come from the content-hash holdout bands of ``HoldoutSpec`` (see
``megaloop.data.txt360``), which ``txt360_to_mds`` excludes from training with the same spec, so
neither set overlaps training (exact duplicates included) and the two sets are disjoint.

* ``val/``: per source, the band's distinct documents in seeded-hash order are tokenised (EOS
  appended), packed into ``val_seq_len`` sequences, and the first ``val_sequences_per_source`` are
  kept. No upsampling: each source contributes its natural documents, balanced by the per-source
  cap (MixVal-style); the ``source`` column allows per-source losses.
* ``screen/``: all sources' screen-band documents pooled in seeded-hash order and packed into
  exactly ``screen_sequences`` x ``screen_seq_len`` tokens (default 304 x 1,536); too little
  text is an error that says how much is missing.

Each set is an MDS directory with ``manifest.json``, built in a temp directory and renamed.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from megaloop.data._fsutil import atomic_write_json, file_lock, init_pool_worker, json_sha, rmtree_quiet
from megaloop.data.errors import DataError
from megaloop.data.mds_convert import FORMAT, check_compression, check_out_dir, mds_columns, token_dtype, \
    write_sequences_mds
from megaloop.data.tokenizer import Tokenizer
from megaloop.data.txt360 import HoldoutSpec, InputFile, discover, read_jsonl


@dataclass
class EvalSetsConfig:
    """Settings of data_prep/build_eval_sets.py."""

    input: Path
    out: Path
    tokenizer: str
    holdout: HoldoutSpec = field(default_factory=HoldoutSpec)
    val_seq_len: int = 2048
    val_sequences_per_source: int = 256
    screen_seq_len: int = 1536
    screen_sequences: int = 304
    seed: int = 1234
    workers: int = 1
    sources: list[str] | None = None
    max_files_per_source: int | None = None
    eos_token: str | None = None
    compression: str | None = "zstd"
    train_manifest: Path | None = None
    progress: bool = True
    command: str | None = None


def _scan(args: tuple[InputFile, HoldoutSpec]) -> list[tuple[str, str, str]]:
    """``(band, source, text)`` of every held-out document of one file."""
    f, holdout = args
    out = []
    for _, text in read_jsonl(f.path):
        if text.strip():
            band = holdout.band(text)
            if band != "train":
                out.append((band, f.source, text))
    return out


def _order_key(text: str, seed: int) -> bytes:
    return hashlib.blake2b(text.encode(), key=f"megaloop-evalorder-{seed}".encode(),
                           digest_size=8).digest()


def _pack(tok: Tokenizer, texts: list[str], seq_len: int, limit: int | None) -> tuple[np.ndarray, int]:
    """Pack texts (+EOS each) into at most ``limit`` rows of ``seq_len``; returns rows, docs used."""
    rows: list[np.ndarray] = []
    buf: list[int] = []
    used = 0
    for i in range(0, len(texts), 256):
        for ids in tok.encode_batch(texts[i:i + 256]):
            buf.extend(ids)
            buf.append(tok.eos_id)
            used += 1
        while len(buf) >= seq_len and (limit is None or len(rows) < limit):
            rows.append(np.asarray(buf[:seq_len], dtype=np.int64))
            del buf[:seq_len]
        if limit is not None and len(rows) >= limit:
            break
    arr = np.stack(rows) if rows else np.zeros((0, seq_len), np.int64)
    return arr.astype(token_dtype(tok.vocab_size)), used


def _publish(out: Path, name: str, rows: np.ndarray, sources: list[str], manifest: dict,
             compression: str | None) -> None:
    """Write one set into a temp dir, then atomically replace ``out/name``."""
    tmp = out / f".tmp-{name}-{uuid.uuid4().hex[:8]}"
    try:
        write_sequences_mds(tmp, rows, sources, compression=compression)
        atomic_write_json(tmp / "manifest.json", manifest)
        final = out / name
        if final.exists():
            old = out / f".old-{name}-{uuid.uuid4().hex[:8]}"
            os.rename(final, old)
            rmtree_quiet(old)
        os.rename(tmp, final)
    finally:
        rmtree_quiet(tmp)


def build_eval_sets(cfg: EvalSetsConfig) -> dict[str, dict]:
    """Build (or reuse, if up to date) ``out/val`` and ``out/screen``; returns their manifests."""
    t0 = time.time()
    for name, low in (("val_seq_len", 2), ("screen_seq_len", 2), ("val_sequences_per_source", 1),
                      ("screen_sequences", 1), ("seed", 0)):
        if getattr(cfg, name) < low:
            raise DataError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(cfg, name)}")
    if cfg.max_files_per_source is not None and cfg.max_files_per_source < 1:
        raise DataError(f"--max-files-per-source must be >= 1 (omit it to scan every file), "
                        f"got {cfg.max_files_per_source}")
    check_compression(cfg.compression)
    check_out_dir(Path(cfg.out))
    if cfg.train_manifest is not None:
        import json

        try:
            tm = json.loads(Path(cfg.train_manifest).read_text())
        except (OSError, ValueError) as err:
            raise DataError(f"--train-manifest {cfg.train_manifest}: cannot read "
                            f"({getattr(err, 'strerror', None) or err})") from None
        if not isinstance(tm, dict):
            raise DataError(f"--train-manifest {cfg.train_manifest}: not a megaloop manifest (a JSON object)")
        if tm.get("holdout") != cfg.holdout.to_dict():
            raise DataError(f"holdout spec {cfg.holdout.to_dict()} differs from the one used for "
                            f"the training shards ({cfg.train_manifest}: {tm.get('holdout')}); "
                            "the eval sets would overlap training")
    files = discover(cfg.input, cfg.sources)
    if cfg.max_files_per_source:
        kept: list[InputFile] = []
        for f in files:  # the first N files of each source, in sorted order
            if sum(k.source == f.source for k in kept) < cfg.max_files_per_source:
                kept.append(f)
        files = kept
    tok = Tokenizer(cfg.tokenizer, eos_token=cfg.eos_token)
    sizes = [(f.part, f.path.stat().st_size, f.path.stat().st_mtime_ns) for f in files]
    common = {"format": FORMAT, "tokenizer_sha256": tok.sha256, "holdout": cfg.holdout.to_dict(),
              "seed": cfg.seed, "files": sizes, "compression": cfg.compression}
    fps = {"val": json_sha(common | {"seq_len": cfg.val_seq_len,
                                     "per_source": cfg.val_sequences_per_source}),
           "screen": json_sha(common | {"seq_len": cfg.screen_seq_len,
                                        "n": cfg.screen_sequences})}
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    with file_lock(out / ".lock", busy=f"--out {out} is in use by another build_eval_sets run"):
        result: dict[str, dict] = {}
        todo = []
        for name in ("val", "screen"):
            try:
                import json

                m = json.loads((out / name / "manifest.json").read_text())
            except (FileNotFoundError, ValueError):
                m = {}
            if m.get("fingerprint") == fps[name]:
                result[name] = m
            else:
                todo.append(name)
        if not todo:
            return result
        docs = _scan_all(files, cfg)
        base = {"format": FORMAT, "input": str(cfg.input), "tokenizer": tok.describe(),
                "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "bos_id": tok.bos_id,
                "pad_id": tok.pad_id, "holdout": cfg.holdout.to_dict(), "seed": cfg.seed,
                "files_scanned": len(files), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "command": cfg.command or " ".join(sys.argv)}
        if "val" in todo:
            result["val"] = _build_val(out, tok, docs, cfg, base | {"fingerprint": fps["val"]})
        if "screen" in todo:
            result["screen"] = _build_screen(out, tok, docs, cfg,
                                             base | {"fingerprint": fps["screen"]})
    for m in result.values():
        m.setdefault("_seconds", time.time() - t0)
    return result


def _scan_all(files: list[InputFile], cfg: EvalSetsConfig) -> dict[str, dict[str, list[str]]]:
    """``{band: {source: [distinct texts in seeded-hash order]}}``."""
    from tqdm import tqdm

    tasks = [(f, cfg.holdout) for f in files]
    results: Iterator[list[tuple[str, str, str]]]
    if cfg.workers > 1 and len(tasks) > 1:
        # as the converter's workers: Ctrl-C is left to this process, and they end with it (killed,
        # even with SIGKILL) instead of scanning on as orphans
        pool = mp.get_context("fork").Pool(min(cfg.workers, len(tasks)), init_pool_worker, (os.getpid(),))
        results = pool.imap(_scan, tasks)
    else:
        pool, results = None, map(_scan, tasks)
    srcs = sorted({f.source for f in files})
    found: dict[str, dict[str, dict[bytes, str]]] = {b: {s: {} for s in srcs} for b in ("val", "screen")}
    try:
        for recs in tqdm(results, total=len(tasks), unit="file", desc="eval-sets scan",
                         disable=not cfg.progress):
            for band, source, text in recs:
                found[band].setdefault(source, {})[_order_key(text, cfg.seed)] = text
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    return {band: {s: [d[k] for k in sorted(d)] for s, d in sorted(by_src.items())}
            for band, by_src in found.items()}


def _build_val(out: Path, tok: Tokenizer, docs: dict, cfg: EvalSetsConfig, base: dict) -> dict:
    rows, srcs, stats = [], [], {}
    for source, texts in docs["val"].items():
        arr, used = _pack(tok, texts, cfg.val_seq_len, cfg.val_sequences_per_source)
        rows.append(arr)
        srcs += [source] * len(arr)
        stats[source] = {"docs_available": len(texts), "docs_used": used,
                         "num_sequences": len(arr), "tokens": int(arr.size)}
    total = sum(len(r) for r in rows)
    if total == 0:
        raise DataError(f"no validation sequence of {cfg.val_seq_len} tokens could be built from "
                        f"{cfg.input}: raise --val-fraction (now {cfg.holdout.val_fraction})")
    arr = np.concatenate(rows)
    manifest = base | {
        "kind": "val", "seq_len": cfg.val_seq_len, "columns": mds_columns(cfg.val_seq_len, str(arr.dtype)),
        "sources": stats, "source_tokens": {s: v["tokens"] for s, v in stats.items()},
        "total_tokens": int(arr.size), "num_sequences": int(len(arr)),
        "sequences_per_source_cap": cfg.val_sequences_per_source,
        "sources_without_val": [s for s, v in stats.items() if not v["num_sequences"]],
        "provenance": "validation band of the content-hash holdout; excluded from training "
                      "shards built with the same holdout spec; distinct docs, no upsampling",
    }
    _publish(out, "val", arr, srcs, manifest, cfg.compression)
    return manifest


def _build_screen(out: Path, tok: Tokenizer, docs: dict, cfg: EvalSetsConfig, base: dict) -> dict:
    pooled = sorted(((_order_key(t, cfg.seed), s, t) for s, ts in docs["screen"].items() for t in ts))
    texts = [t for _, _, t in pooled]
    arr, used = _pack(tok, texts, cfg.screen_seq_len, cfg.screen_sequences)
    if len(arr) < cfg.screen_sequences:
        need = cfg.screen_sequences * cfg.screen_seq_len
        raise DataError(f"LR-screen set needs {cfg.screen_sequences} x {cfg.screen_seq_len} = {need:,}"
                        f" tokens but the screen band of {cfg.input} yields only "
                        f"{len(arr) * cfg.screen_seq_len:,}; raise --screen-fraction (now "
                        f"{cfg.holdout.screen_fraction}) or lower --screen-sequences")
    # Source of a row = source of the document that starts it (rows may straddle documents).
    doc_src = [s for _, s, _ in pooled[:used]]
    lens = np.cumsum([len(x) + 1 for x in tok.encode_batch(texts[:used])])
    starts = np.arange(len(arr)) * cfg.screen_seq_len
    srcs = [doc_src[int(np.searchsorted(lens, p, side="right"))] for p in starts]
    per_src: dict[str, int] = {}
    for s in srcs:
        per_src[s] = per_src.get(s, 0) + 1
    manifest = base | {
        "kind": "screen", "seq_len": cfg.screen_seq_len,
        "columns": mds_columns(cfg.screen_seq_len, str(arr.dtype)), "docs_used": used,
        "sequences_by_source": dict(sorted(per_src.items())), "total_tokens": int(arr.size),
        "num_sequences": int(len(arr)),
        "provenance": "LR-screen band of the content-hash holdout (disjoint from the validation "
                      "band); excluded from training; pooled over sources in seeded-hash order",
    }
    _publish(out, "screen", arr, srcs, manifest, cfg.compression)
    return manifest
