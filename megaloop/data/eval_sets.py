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

Each set is an MDS directory with ``manifest.json`` (recording the ``settings`` it was built with).
Both are packed and checked before anything is written, then written into temp directories and
renamed into place one after the other (a kill between those renames is put right by the same command
run again); a set already there stays until its replacement is complete, and one
built with other settings is replaced only with ``overwrite`` (see :func:`build_eval_sets`).
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from megaloop.data._fsutil import atomic_write_json, file_lock, init_pool_worker, json_sha, rmtree_quiet
from megaloop.data._pool import ForkPool
from megaloop.data.errors import DataError
from megaloop.data.mds_convert import FORMAT, check_compression, check_out_dir, mds_columns, token_dtype, \
    write_sequences_mds
from megaloop.data.tokenizer import Tokenizer
from megaloop.data.txt360 import HoldoutSpec, InputFile, check_out_outside_input, discover, read_jsonl


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
    overwrite: bool = False  # replace sets in ``out`` built with other settings (refused otherwise)


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
    """Pack texts (+EOS each) into at most ``limit`` rows of ``seq_len``; returns rows and the documents
    used: those with a token in a row (it counted every document encoded, in batches of 256)."""
    rows: list[np.ndarray] = []
    buf: list[int] = []
    starts: list[int] = []  # each document's first token, counted over the whole stream
    fed = 0
    for i in range(0, len(texts), 256):
        for ids in tok.encode_batch(texts[i:i + 256]):
            starts.append(fed)
            buf.extend(ids)
            buf.append(tok.eos_id)
            fed += len(ids) + 1
        while len(buf) >= seq_len and (limit is None or len(rows) < limit):
            rows.append(np.asarray(buf[:seq_len], dtype=np.int64))
            del buf[:seq_len]
        if limit is not None and len(rows) >= limit:
            break
    arr = np.stack(rows) if rows else np.zeros((0, seq_len), np.int64)
    used = bisect.bisect_left(starts, len(rows) * seq_len)
    return arr.astype(token_dtype(tok.vocab_size)), used


def build_eval_sets(cfg: EvalSetsConfig) -> dict[str, dict]:
    """Build (or reuse, if up to date) ``out/val`` and ``out/screen``; returns their manifests.

    Everything is checked before anything is written: flags, ``--train-manifest``, an ``--out`` that
    holds an MDS dataset (training shards) or lies inside the input tree, sets in ``--out`` built with
    other settings (refused, naming each difference, unless ``overwrite``), and that both sets can be
    filled. Both sets are then written into temporary folders and renamed into place, one then the other: an
    existing set stays as it was until the new ones are complete (or if the build fails)."""
    t0 = time.time()
    for name, low in (("val_seq_len", 2), ("screen_seq_len", 2), ("val_sequences_per_source", 1),
                      ("screen_sequences", 1), ("seed", 0), ("workers", 1)):
        if getattr(cfg, name) < low:
            raise DataError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(cfg, name)}")
    if cfg.max_files_per_source is not None and cfg.max_files_per_source < 1:
        raise DataError(f"--max-files-per-source must be >= 1 (omit it to scan every file), "
                        f"got {cfg.max_files_per_source}")
    check_compression(cfg.compression)
    out = Path(cfg.out)
    check_out_dir(out)
    _refuse_dataset_out(out)
    train_manifest = _check_train_manifest(Path(cfg.train_manifest), cfg.holdout) if cfg.train_manifest else None
    files = discover(cfg.input, cfg.sources)
    check_out_outside_input(cfg.input, out)
    if cfg.max_files_per_source:
        kept: list[InputFile] = []
        for f in files:  # the first N files of each source, in sorted order
            if sum(k.source == f.source for k in kept) < cfg.max_files_per_source:
                kept.append(f)
        files = kept
    tok = Tokenizer(cfg.tokenizer, eos_token=cfg.eos_token)
    if train_manifest is not None:  # the ids the training data holds: another tokenizer or EOS was
        _check_train_tokenizer(Path(cfg.train_manifest), train_manifest, tok)  # accepted, refused by train later
    sizes = [(f.part, f.path.stat().st_size, f.path.stat().st_mtime_ns) for f in files]
    common = {"format": FORMAT, "tokenizer_sha256": tok.sha256, "holdout": cfg.holdout.to_dict(),
              "seed": cfg.seed, "files": sizes, "compression": cfg.compression}
    fps = {"val": json_sha(common | {"seq_len": cfg.val_seq_len,
                                     "per_source": cfg.val_sequences_per_source}),
           "screen": json_sha(common | {"seq_len": cfg.screen_seq_len,
                                        "n": cfg.screen_sequences})}
    settings = _settings(cfg, tok)
    if out.is_dir():  # before the lock file: refuse a folder without touching it
        _existing_sets(out, fps, settings, cfg.overwrite)
    out.mkdir(parents=True, exist_ok=True)
    with file_lock(out / ".lock", busy=f"--out {out} is in use by another build_eval_sets run",
                   drop_if=lambda: os.listdir(out) == [".lock"]):  # a failed build into an empty --out
        _recover(out)
        result = _existing_sets(out, fps, settings, cfg.overwrite, say=True)
        todo = [name for name in ("val", "screen") if name not in result]
        if not todo:
            return result
        docs = _scan_all(files, cfg)
        base = {"format": FORMAT, "input": str(cfg.input), "tokenizer": tok.describe(),
                "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "bos_id": tok.bos_id,
                "pad_id": tok.pad_id, "holdout": cfg.holdout.to_dict(), "seed": cfg.seed,
                "files_scanned": len(files), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "command": cfg.command or " ".join(sys.argv)}
        built = {}
        if "val" in todo:
            built["val"] = _build_val(tok, docs, cfg, base | {"fingerprint": fps["val"], "settings": settings["val"]})
        if "screen" in todo:
            built["screen"] = _build_screen(tok, docs, cfg, base | {"fingerprint": fps["screen"],
                                                                    "settings": settings["screen"]})
        _publish(out, built, cfg.compression)  # both sets could be built: write them, then rename both
        result |= {name: manifest for name, (_, _, manifest) in built.items()}
    for m in result.values():
        m.setdefault("_seconds", time.time() - t0)
    return result


def _check_train_manifest(path: Path, holdout: HoldoutSpec) -> dict:
    """``--train-manifest`` must be the converter's manifest, with ``holdout``'s bands; returns it."""
    if path.is_dir():
        hint = f"; pass {path / 'manifest.json'}" if (path / "manifest.json").is_file() else ""
        raise DataError(f"--train-manifest {path}: is a folder, not a manifest.json{hint}")
    try:
        tm = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise DataError(f"--train-manifest {path}: cannot read ({getattr(err, 'strerror', None) or err})") from None
    if not isinstance(tm, dict) or "shards" in tm or "holdout" not in tm or tm.get("format", FORMAT) != FORMAT:
        what = ("an MDS index.json" if isinstance(tm, dict) and "shards" in tm
                else "no holdout spec in it" if isinstance(tm, dict) and "holdout" not in tm
                else f"format {tm.get('format')!r}, not {FORMAT!r}" if isinstance(tm, dict) else "not a JSON object")
        raise DataError(f"--train-manifest {path}: not a megaloop manifest ({what}); pass the manifest.json "
                        "that data_prep/txt360_to_mds.py wrote in its --out")
    if tm.get("kind", "train") != "train":
        raise DataError(f"--train-manifest {path}: the manifest of a {tm['kind']!r} set, not of training shards; "
                        "pass the manifest.json that data_prep/txt360_to_mds.py wrote in its --out")
    if tm.get("holdout") != holdout.to_dict():
        raise DataError(f"holdout spec {holdout.to_dict()} differs from the one used for "
                        f"the training shards ({path}: {tm.get('holdout')}); "
                        "the eval sets would overlap training")
    return tm


def _check_train_tokenizer(path: Path, tm: dict, tok: Tokenizer) -> None:
    """``tok`` (with its ``--eos-token``) must be the tokenizer of the training manifest ``tm`` (at ``path``)."""
    from megaloop.data.tokenizer import manifest_eos_id, manifest_tokenizer_sha256

    want = manifest_tokenizer_sha256(tm)
    if want and want not in tok.sha256s:
        raise DataError(f"--tokenizer {tok.path} (sha256 {tok.sha256[:12]}…) is not the tokenizer of the training "
                        f"data ({path}: {want[:12]}…); the eval sets would hold other token ids")
    eos = manifest_eos_id(tm)
    if eos is not None and eos != tok.eos_id:
        raise DataError(f"--eos-token: EOS id {tok.eos_id}, the training data's is {eos} ({path}); documents "
                        "would end with another token")


def _refuse_dataset_out(out: Path) -> None:
    """An ``--out`` holding an MDS dataset (training shards, or an eval set itself) is not an eval-sets
    folder: val/ and screen/ would be written inside the dataset."""
    marks = [n for n in ("index.json", "manifest.json", "parts") if os.path.lexists(out / n)]
    if marks:
        kind = (_load_json(out / "manifest.json") or {}).get("kind")
        what = f"a {kind!r} dataset" if isinstance(kind, str) else "an MDS dataset"
        raise DataError(f"--out {out} holds {what} ({', '.join(marks)}); the eval sets go into val/ and screen/ "
                        "of a folder of their own: choose another --out")


def _settings(cfg: EvalSetsConfig, tok: Tokenizer) -> dict[str, dict]:
    """What each set is built from and with (recorded in its manifest, compared on a rebuild)."""
    common = {"input": str(Path(cfg.input).resolve()), "tokenizer_sha256": tok.sha256, "eos_id": tok.eos_id,
              "holdout": cfg.holdout.to_dict(), "seed": cfg.seed, "compression": cfg.compression,
              "sources": sorted(cfg.sources) if cfg.sources else None,
              "max_files_per_source": cfg.max_files_per_source}
    return {"val": common | {"seq_len": cfg.val_seq_len, "sequences_per_source": cfg.val_sequences_per_source},
            "screen": common | {"seq_len": cfg.screen_seq_len, "sequences": cfg.screen_sequences}}


def _recorded_settings(m: dict, name: str) -> dict:
    """The settings of an existing set: its ``settings``, or (built before they were recorded) what
    its manifest tells."""
    if isinstance(m.get("settings"), dict):
        return m["settings"]
    old = {"input": str(Path(str(m["input"])).resolve()) if "input" in m else None,
           "tokenizer_sha256": (m.get("tokenizer") or {}).get("sha256"), "eos_id": m.get("eos_id"),
           "holdout": m.get("holdout"), "seed": m.get("seed"), "seq_len": m.get("seq_len"),
           "sequences_per_source" if name == "val" else "sequences":
               m.get("sequences_per_source_cap" if name == "val" else "num_sequences")}
    return {k: v for k, v in old.items() if v is not None}


def _existing_sets(out: Path, fps: dict[str, str], settings: dict[str, dict], overwrite: bool,
                   say: bool = False) -> dict[str, dict]:
    """The sets in ``out`` that are up to date (their manifests). A set built with other settings is
    refused unless ``overwrite``; one whose input files changed since is rebuilt (``say``: a note).
    A ``val``/``screen`` folder this tool did not write is never replaced."""
    current: dict[str, dict] = {}
    diffs: list[str] = []
    for name in ("val", "screen"):
        folder = out / name
        if not os.path.lexists(folder):
            continue
        m = _load_json(folder / "manifest.json")
        if m is None or m.get("kind", name) != name:
            raise DataError(f"--out {out}: {folder} is not a {name} set written by this tool (no readable "
                            "manifest.json); move it away or choose another --out")
        if m.get("fingerprint") == fps[name]:
            current[name] = m
            continue
        old = _recorded_settings(m, name)
        diff = [f"{k}: {old[k]!r} -> {v!r}" for k, v in settings[name].items() if k in old and old[k] != v]
        if diff and not overwrite:
            diffs.append(f"{name}/ ({'; '.join(diff)})")
        elif say:
            why = "--overwrite" if diff else "its input files changed since it was built"
            print(f"note: rebuilding {folder} ({why}); the old set stays until the new one is complete",
                  file=sys.stderr)
    if diffs:
        raise DataError(f"--out {out} holds eval sets built with other settings: {', '.join(diffs)}; pass "
                        "--overwrite to replace them, or choose another --out")
    return current


def _load_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _recover(out: Path) -> None:
    """Under the lock: put back a set whose replacement was cut short between its two renames (only
    ``.old-NAME-*`` is left), and remove the other temporary folders of earlier runs."""
    for name in ("val", "screen"):
        olds = sorted(out.glob(f".old-{name}-*"), key=lambda p: p.stat().st_mtime_ns)
        if not (out / name).exists() and olds and (olds[-1] / "manifest.json").is_file():
            os.rename(olds[-1], out / name)
            print(f"note: {out / name} restored (a replacement of it was interrupted)", file=sys.stderr)
    for p in (*out.glob(".tmp-val-*"), *out.glob(".tmp-screen-*"), *out.glob(".old-val-*"),
              *out.glob(".old-screen-*")):
        rmtree_quiet(p)


def _publish(out: Path, built: dict[str, tuple[np.ndarray, list[str], dict]], compression: str | None) -> None:
    """Write every built set into a temporary folder of ``out``, then rename each into place; an old
    set is moved aside first and removed only once all are in place (put back if a rename fails)."""
    staged: dict[str, Path] = {}
    try:
        for name, (rows, sources, manifest) in built.items():
            staged[name] = out / f".tmp-{name}-{uuid.uuid4().hex[:8]}"
            write_sequences_mds(staged[name], rows, sources, compression=compression)
            atomic_write_json(staged[name] / "manifest.json", manifest)
        olds: dict[str, Path] = {}
        swapped: list[str] = []
        try:
            for name, tmp in staged.items():
                final = out / name
                if os.path.lexists(final):
                    olds[name] = out / f".old-{name}-{uuid.uuid4().hex[:8]}"
                    os.rename(final, olds[name])
                os.rename(tmp, final)
                swapped.append(name)
        except BaseException:
            for name in reversed(list(staged)):
                with contextlib.suppress(OSError):
                    if name in swapped:
                        os.rename(out / name, staged[name])
                    if name in olds:
                        os.rename(olds[name], out / name)
            raise
        for old in olds.values():
            rmtree_quiet(old)
    finally:
        for tmp in staged.values():
            rmtree_quiet(tmp)


def _scan_all(files: list[InputFile], cfg: EvalSetsConfig) -> dict[str, dict[str, list[str]]]:
    """``{band: {source: [distinct texts in seeded-hash order]}}``."""
    from tqdm import tqdm

    tasks = [(f, cfg.holdout) for f in files]
    srcs = sorted({f.source for f in files})
    found: dict[str, dict[str, dict[bytes, str]]] = {b: {s: {} for s in srcs} for b in ("val", "screen")}

    def collect(results: Iterator[list[tuple[str, str, str]]]) -> None:
        for recs in tqdm(results, total=len(tasks), unit="file", desc="eval-sets scan",
                         disable=not cfg.progress):
            for band, source, text in recs:
                found[band].setdefault(source, {})[_order_key(text, cfg.seed)] = text

    if cfg.workers > 1 and len(tasks) > 1:
        # as the converter's workers: Ctrl-C is left to this process, and they end with it (killed,
        # even with SIGKILL) instead of scanning on as orphans
        with ForkPool(min(cfg.workers, len(tasks)), init_pool_worker, (os.getpid(),)) as pool:
            collect(pool.imap(_scan, tasks, describe=lambda t: str(t[0].path)))
    else:
        collect(map(_scan, tasks))
    return {band: {s: [d[k] for k in sorted(d)] for s, d in sorted(by_src.items())}
            for band, by_src in found.items()}


def _build_val(tok: Tokenizer, docs: dict, cfg: EvalSetsConfig, base: dict) -> tuple[np.ndarray, list[str], dict]:
    rows, srcs, stats = [], [], {}
    for source, texts in docs["val"].items():
        arr, used = _pack(tok, texts, cfg.val_seq_len, cfg.val_sequences_per_source)
        rows.append(arr)
        srcs += [source] * len(arr)
        stats[source] = {"docs_available": len(texts), "docs_used": used,
                         "num_sequences": len(arr), "tokens": int(arr.size)}
    total = sum(len(r) for r in rows)
    if total == 0:
        held = sum(len(t) for t in docs["val"].values())
        why = (f"none of its documents falls in the validation band: raise --val-fraction (now "
               f"{cfg.holdout.val_fraction})" if not held else
               f"the {held} document(s) of its validation band do not fill one: lower --val-seq-len or raise "
               f"--val-fraction (now {cfg.holdout.val_fraction})")
        raise DataError(f"no validation sequence of {cfg.val_seq_len} tokens could be built from {cfg.input}: {why}")
    if missing := [s for s, v in stats.items() if not v["num_sequences"]]:  # it was in the manifest alone
        print(f"warning: no validation sequence of {cfg.val_seq_len} tokens from source(s) {', '.join(missing)} "
              "(too little held-out text): the set leaves them out (manifest: sources_without_val)",
              file=sys.stderr, flush=True)
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
    return arr, srcs, manifest


def _build_screen(tok: Tokenizer, docs: dict, cfg: EvalSetsConfig, base: dict) -> tuple[np.ndarray, list[str],
                                                                                        dict]:
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
    return arr, srcs, manifest
