"""TxT360 tree -> packed, tokenised MDS shards (the engine behind data_prep/txt360_to_mds.py).

Every input file is one partition, processed independently (in parallel worker processes): read
records, drop held-out documents, tokenise, append EOS, repeat documents by their mixture
multiplier, shuffle the document order with a per-partition seed, concatenate, cut into
``seq_len``-token sequences and write MDS shards (columns ``tokens: ndarray:<uint16|uint32>:seq_len``,
``source: str``; zstd).

Packing (``ConvertConfig.packing`` / ``--packing``):

* ``concat`` (default): the documents are concatenated and cut every ``seq_len`` tokens, so rows
  start and end mid-document; the tail shorter than ``seq_len`` is dropped and counted.
* ``whole``: no document crosses a row. Documents are placed in their shuffled order, next-fit:
  a document that does not fit in the current row's remaining room closes that row, whose rest is
  filled with the pad id (the tokenizer's, else EOS), and starts the next one. Each row stores its
  real-token count in an extra ``num_tokens: int32`` column; the loaders set ``loss_mask`` to 0
  from position ``num_tokens - 1`` on (targets that are padding), so padding never reaches the
  loss. A document longer than ``seq_len`` (EOS included) is an error naming ``file:line``; nothing
  is truncated. The last, partly filled row is kept (no token is dropped).

Crash safety: a partition is written under ``OUT/.tmp/`` and renamed to ``OUT/parts/<name>/``
only after its ``_done.json`` is in place; ``OUT/index.json`` (all shards) and then
``OUT/manifest.json`` are written last, atomically. A rerun with the same settings skips finished
partitions; a dataset without ``manifest.json`` is incomplete and the loader refuses it. An update of
a dataset already published (changed or added input files, or ``--overwrite``) renames its new
partitions into ``OUT/.staged/`` instead: the published ``index.json``, ``manifest.json`` and the parts
they list stay untouched until every partition is done, then the staged parts replace their old ones
and the new index and manifest are written (unpublished only for those renames). An interrupted
update leaves the earlier dataset published; a rerun reuses the staged partitions.

One conversion per ``OUT`` at a time: ``OUT/.lock`` (holding ``pid N on HOST``); a second one prints
one line naming the holder and waits for it (then resumes or reuses its result). Worker processes
do not inherit the lock and end when the converter process dies, however it dies.
"""

from __future__ import annotations

import math
import os
import re
import sys
import time
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from megaloop.data._fsutil import atomic_write_json, check_out_writable, file_lock, init_pool_worker, json_sha, \
    rmtree_quiet
from megaloop.data._pool import ForkPool
from megaloop.data.errors import DataError, NothingPackedError
from megaloop.data.tokenizer import Tokenizer
from megaloop.data.txt360 import HoldoutSpec, InputFile, MixSpec, check_out_outside_input, copies_per_doc, \
    discover, doc_rank_key, part_dirname, read_jsonl

FORMAT = "megaloop-mds-v1"
DONE = "_done.json"
STAGED = ".staged"  # parts of an in-place update, moved into parts/ once all are converted
_STAT_KEYS = ("files", "docs", "docs_val", "docs_screen", "docs_empty", "raw_tokens",
              "doc_tokens", "packed_tokens", "dropped_tokens", "pad_tokens", "num_sequences")
PACKINGS = ("concat", "whole")


def token_dtype(vocab_size: int) -> str:
    """Smallest unsigned dtype holding every token id."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def mds_columns(seq_len: int, dtype: str, packing: str = "concat") -> dict[str, str]:
    """MDS column encodings of megaloop token datasets (``whole`` packing adds ``num_tokens``)."""
    cols = {"tokens": f"ndarray:{dtype}:{seq_len}", "source": "str"}
    return cols | {"num_tokens": "int32"} if packing == "whole" else cols


def pack_whole(docs: Sequence[np.ndarray], seq_len: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Next-fit packing that keeps documents whole: ``docs`` (each <= ``seq_len`` tokens, in this
    order) -> rows [n, seq_len] padded with ``pad_id`` and their real-token counts [n] (int32)."""
    starts: list[int] = []  # index of each row's first document
    used = seq_len
    for i, d in enumerate(docs):
        if used + len(d) > seq_len:
            starts.append(i)
            used = 0
        used += len(d)
    rows = np.full((len(starts), seq_len), pad_id, dtype=np.uint32)
    counts = np.zeros(len(starts), dtype=np.int32)
    bounds = starts + [len(docs)]
    for r in range(len(starts)):
        row = np.concatenate([docs[i] for i in range(bounds[r], bounds[r + 1])])
        rows[r, :len(row)] = row
        counts[r] = len(row)
    return rows, counts


def check_compression(compression: str | None, flag: str = "--compression") -> None:
    """Refuse a shard codec the streaming library cannot write, before any work."""
    if compression is None:
        return
    from megaloop.data._streaming_compat import ensure_streaming_importable

    ensure_streaming_importable()
    from streaming.base.compression import is_compression

    if not is_compression(compression):
        raise DataError(f"{flag}: unknown codec {compression!r}; use none, zstd[:1-22], gz[:0-9], bz2[:1-9], "
                        "br[:0-11] or snappy")


def check_out_dir(out: Path, flag: str = "--out") -> None:
    """``out`` is a directory or does not exist yet, and this process can create it or write into it."""
    check_out_writable(out, flag)


def write_sequences_mds(out_dir: str | Path, tokens: np.ndarray, sources: Sequence[str] | str,
                        *, compression: str | None = "zstd", size_limit: int = 1 << 26,
                        num_tokens: np.ndarray | None = None) -> list[dict]:
    """Write ``tokens`` [n, seq_len] (one row per sample) as MDS into a new ``out_dir``;
    ``num_tokens`` [n] (real tokens per row, ``whole`` packing) adds that column.

    Returns the shard entries of the written ``index.json``.
    """
    from megaloop.data._streaming_compat import ensure_streaming_importable

    streaming = ensure_streaming_importable()
    import json

    out_dir = Path(out_dir)
    n, seq_len = tokens.shape
    src = [sources] * n if isinstance(sources, str) else list(sources)
    cols = mds_columns(seq_len, str(tokens.dtype), "concat" if num_tokens is None else "whole")
    with streaming.MDSWriter(out=str(out_dir), columns=cols, compression=compression,
                             hashes=["xxh64"], size_limit=size_limit) as writer:
        for i, (row, s) in enumerate(zip(tokens, src)):
            sample = {"tokens": row, "source": s}
            if num_tokens is not None:
                sample["num_tokens"] = int(num_tokens[i])
            writer.write(sample)
    return json.loads((out_dir / "index.json").read_text())["shards"]


def write_root_index(out: Path, parts: list[tuple[str, list[dict]]]) -> None:
    """``out/index.json`` listing every part's shards with basenames relative to ``out``."""
    shards = []
    for rel, entries in parts:
        for e in entries:
            e = dict(e)
            for key in ("raw_data", "zip_data"):
                if e.get(key):
                    e[key] = dict(e[key], basename=f"{rel}/{e[key]['basename']}")
            shards.append(e)
    atomic_write_json(out / "index.json", {"version": 2, "shards": shards})


@dataclass
class ConvertConfig:
    """Settings of one conversion (see data_prep/txt360_to_mds.py for the CLI)."""

    input: Path
    out: Path
    tokenizer: str
    seq_len: int
    workers: int = 1
    seed: int = 1234
    mix: MixSpec = field(default_factory=MixSpec)
    holdout: HoldoutSpec = field(default_factory=HoldoutSpec)
    sources: list[str] | None = None
    eos_token: str | None = None
    compression: str | None = "zstd"
    shard_size_limit: int = 1 << 26
    progress: bool = True
    command: str | None = None
    packing: str = "concat"  # concat | whole (documents never cross a row; see the module doc)
    overwrite: bool = False  # replace a dataset in ``out`` converted with other settings / input


@dataclass
class _Task:
    file: InputFile
    multiplier: float
    fingerprint: str
    final_dir: Path
    tmp_root: Path
    seq_len: int
    seed: int
    holdout: HoldoutSpec
    dtype: str
    compression: str | None
    size_limit: int
    packing: str = "concat"
    pad_id: int = 0


_WORKER_TOK: Tokenizer | None = None


def _init_worker(tok_path: str, eos_token: str | None, parent: int) -> None:
    global _WORKER_TOK
    init_pool_worker(parent)  # SIGTERM default, SIGINT ignored, ends when the converter dies
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _WORKER_TOK = Tokenizer(tok_path, eos_token=eos_token)


def _process_part(task: _Task) -> dict:
    """Convert one input file into a finished part directory; return its stats."""
    tok = _WORKER_TOK
    assert tok is not None
    f = task.file
    texts: list[str] = []
    lines: list[int] = []
    stats = dict.fromkeys(_STAT_KEYS, 0)
    stats["files"] = 1
    for lineno, text in read_jsonl(f.path):
        if not text.strip():
            stats["docs_empty"] += 1
            continue
        band = task.holdout.band(text)
        if band != "train":
            stats[f"docs_{band}"] += 1
            continue
        texts.append(text)
        lines.append(lineno)
    stats["docs"] = len(texts)
    docs: list[np.ndarray] = []
    for i in range(0, len(texts), 256):
        for ids in tok.encode_batch(texts[i:i + 256]):
            ids.append(tok.eos_id)
            docs.append(np.asarray(ids, dtype=np.uint32))
    lens = np.array([len(d) for d in docs], dtype=np.int64)
    if task.packing == "whole" and len(lens) and lens.max() > task.seq_len:
        i = int(np.argmax(lens > task.seq_len))
        raise DataError(f"{f.path}:{lines[i]}: document of {lens[i]} tokens (EOS included) is longer "
                        f"than --seq-len {task.seq_len}; --packing whole never splits a document "
                        "(raise --seq-len, drop the document, or use --packing concat)")
    keys = np.array([doc_rank_key(t, task.seed) for t in texts], dtype=np.float64)
    copies = copies_per_doc(keys, task.multiplier)
    order = np.repeat(np.arange(len(docs)), copies)
    rng = np.random.default_rng([task.seed, zlib.crc32(f.part.encode())])
    rng.shuffle(order)
    counts: np.ndarray | None = None
    if task.packing == "whole":
        rows, counts = pack_whole([docs[i] for i in order], task.seq_len, task.pad_id)
        packed, n_seq = rows.astype(task.dtype), len(rows)
        real, dropped = int(counts.sum()), 0
    else:
        flat = np.concatenate([docs[i] for i in order]) if len(order) else np.zeros(0, np.uint32)
        n_seq = len(flat) // task.seq_len
        packed = flat[: n_seq * task.seq_len].reshape(n_seq, task.seq_len).astype(task.dtype)
        real, dropped = int(packed.size), int(len(flat) - packed.size)
    stats.update(raw_tokens=int(lens.sum()), doc_tokens=int((lens * copies).sum()),
                 packed_tokens=real, dropped_tokens=dropped, pad_tokens=int(packed.size) - real,
                 num_sequences=int(n_seq))
    tmp = task.tmp_root / uuid.uuid4().hex
    shards = write_sequences_mds(tmp, packed, f.source, compression=task.compression,
                                 size_limit=task.size_limit, num_tokens=counts) if n_seq else []
    tmp.mkdir(parents=True, exist_ok=True)
    done = {"part": f.part, "source": f.source, "bucket": f.bucket, "input": str(f.path),
            "multiplier": task.multiplier, "fingerprint": task.fingerprint, "stats": stats,
            "shards": shards}
    atomic_write_json(tmp / DONE, done)
    rmtree_quiet(task.final_dir)
    os.rename(tmp, task.final_dir)
    return done


def _load_done(path: Path) -> dict | None:
    import json

    try:
        return json.loads((path / DONE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _aggregate(dones: list[dict]) -> dict[str, Any]:
    sources: dict[str, Any] = {}
    for d in dones:
        s = sources.setdefault(d["source"], dict.fromkeys(_STAT_KEYS, 0) | {"buckets": {}})
        b = s["buckets"].setdefault(d["bucket"], dict.fromkeys(_STAT_KEYS, 0)
                                    | {"multiplier": d["multiplier"]})
        for k in _STAT_KEYS:  # .get: parts finished before a key existed (pad_tokens) count 0
            s[k] += d["stats"].get(k, 0)
            b[k] += d["stats"].get(k, 0)
    return dict(sorted(sources.items()))


def convert_txt360(cfg: ConvertConfig) -> dict:
    """Run (or resume) a conversion; returns the manifest (also written to ``out/manifest.json``).

    The returned dict has an extra ``_run`` entry ``{parts_total, parts_skipped, seconds}``.
    """
    t0 = time.time()
    if cfg.seq_len < 2:
        raise DataError(f"--seq-len must be >= 2, got {cfg.seq_len}")
    if cfg.packing not in PACKINGS:
        raise DataError(f"--packing must be one of {PACKINGS}, got {cfg.packing!r}")
    if cfg.seed < 0:
        raise DataError(f"--seed must be >= 0, got {cfg.seed}")
    if cfg.shard_size_limit < 1:
        raise DataError(f"--shard-size must be >= 1 byte, got {cfg.shard_size_limit}")
    if cfg.workers < 1:
        raise DataError(f"--workers must be >= 1, got {cfg.workers}")
    check_compression(cfg.compression)
    check_out_dir(Path(cfg.out))
    files = discover(cfg.input, cfg.sources)
    check_out_outside_input(cfg.input, cfg.out)
    cfg.mix.check_sources(sorted({f.source for f in files}))
    # absolute: the manifest's tokenizer path is how evaluation finds a run's tokenizer
    tok = Tokenizer(Path(cfg.tokenizer).resolve(), eos_token=cfg.eos_token)
    dtype = token_dtype(tok.vocab_size)
    out = Path(cfg.out)
    common = {"format": FORMAT, "tokenizer_sha256": tok.sha256, "eos_id": tok.eos_id,
              "seq_len": cfg.seq_len, "seed": cfg.seed, "holdout": cfg.holdout.to_dict(),
              "compression": cfg.compression, "dtype": dtype}
    pad_id = tok.pad_id if tok.pad_id is not None else tok.eos_id
    if cfg.packing != "concat":  # concat datasets keep their earlier fingerprints
        common |= {"packing": cfg.packing, "pad_fill_id": pad_id}
    tasks: list[_Task] = []
    for f in files:
        st = f.path.stat()
        m = cfg.mix.multiplier(f.source, f.bucket)
        # fractional copies are chosen per document (a product such as 0.7 x 10 counts as whole)
        extra = {} if math.isclose(m, round(m), abs_tol=1e-9) else {"upsample": "per-document"}
        fp = json_sha(common | {"part": f.part, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                                "multiplier": m} | extra)
        tasks.append(_Task(f, m, fp, out / "parts" / part_dirname(f.part), out / ".tmp",
                           cfg.seq_len, cfg.seed, cfg.holdout, dtype, cfg.compression,
                           cfg.shard_size_limit, cfg.packing, pad_id))
    fingerprint = json_sha(common | {"parts": [t.fingerprint for t in tasks]})
    selection = {"input": str(cfg.input), "selected_sources": sorted(cfg.sources) if cfg.sources else None,
                 "mix": cfg.mix.to_dict()}
    if out.is_dir() and not cfg.overwrite:  # before the lock file: refuse a folder without touching it
        old = _load_json(out / "manifest.json")
        if not (old and old.get("fingerprint") == fingerprint):
            _refuse_foreign(out, old, common | selection)
    out.mkdir(parents=True, exist_ok=True)
    with file_lock(out / ".lock", busy=f"--out {out} is in use by another conversion"):
        manifest_path = out / "manifest.json"
        old = _load_json(manifest_path)
        if old and old.get("fingerprint") == fingerprint:
            rmtree_quiet(out / STAGED)  # parts of an update given up since
            return old | {"_run": {"parts_total": len(tasks), "parts_skipped": len(tasks),
                                   "seconds": time.time() - t0}}
        if not cfg.overwrite:
            _refuse_foreign(out, old, common | selection)
        # A dataset already published here stays published (index.json, manifest.json and the parts they
        # list untouched) until every new part is converted: those wait in OUT/.staged/ and replace their
        # old parts in the publish step below. Without one, parts go straight to parts/.
        published = old is not None and (out / "index.json").is_file()
        if not published:
            for name in ("manifest.json", "index.json"):
                (out / name).unlink(missing_ok=True)
        rmtree_quiet(out / ".tmp")
        for p in out.iterdir():
            if _MARK_TMP.fullmatch(p.name):
                p.unlink(missing_ok=True)
        (out / ".tmp").mkdir()
        (out / "parts").mkdir(exist_ok=True)
        dones, todo = _finished_parts(out, tasks, published)
        keep = {t.final_dir.name for t in tasks}
        stale = [p for p in (out / "parts").iterdir() if p.name not in keep and (p / DONE).is_file()]
        if stale:  # parts of input files that are gone; anything this tool did not write stays
            print(f"note: removing {len(stale)} part(s) of {out} whose input file is no longer in "
                  f"{cfg.input}: {sorted(p.name for p in stale)[:5]}", file=sys.stderr)
        try:
            _run_tasks(todo, cfg, tok, dones, total=len(tasks))
            ordered = [dones[t.file.part] for t in tasks]
            sources = _aggregate(ordered)
            if sum(v["num_sequences"] for v in sources.values()) == 0:  # before index.json: no empty dataset
                raise _nothing_packed(cfg, sources, kept=out if published else None)
            # publish: the dataset is unmarked only while the staged parts are renamed into parts/
            for name in ("manifest.json", "index.json"):
                (out / name).unlink(missing_ok=True)
            for t in tasks:
                if t.final_dir.parent.name == STAGED and (_load_done(t.final_dir) or {}).get(
                        "fingerprint") == t.fingerprint:
                    _replace_dir(t.final_dir, out / "parts" / t.final_dir.name, out / ".tmp")
            for p in stale:
                os.rename(p, out / ".tmp" / f"stale-{p.name}")
            write_root_index(out, [(f"parts/{t.final_dir.name}", d["shards"])
                                   for t, d in zip(tasks, ordered)])
            manifest = {
                **common, "kind": "train", "fingerprint": fingerprint, "input": str(cfg.input),
                "selected_sources": selection["selected_sources"],
                "tokenizer": tok.describe(), "vocab_size": tok.vocab_size, "bos_id": tok.bos_id,
                "pad_id": tok.pad_id, "columns": mds_columns(cfg.seq_len, dtype, cfg.packing),
                "packing": cfg.packing, "pad_fill_id": pad_id,
                "mix": cfg.mix.to_dict(), "sources": sources,
                "source_tokens": {k: v["packed_tokens"] for k, v in sources.items()},
                "total_tokens": sum(v["packed_tokens"] for v in sources.values()),
                "num_sequences": sum(v["num_sequences"] for v in sources.values()),
                "dropped_tokens": sum(v["dropped_tokens"] for v in sources.values()),
                "pad_tokens": sum(v["pad_tokens"] for v in sources.values()),
                "num_parts": len(tasks), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "command": cfg.command or " ".join(sys.argv),
            }
            atomic_write_json(manifest_path, manifest)
            rmtree_quiet(out / STAGED)
        finally:
            rmtree_quiet(out / ".tmp")
    return manifest | {"_run": {"parts_total": len(tasks), "parts_skipped": len(tasks) - len(todo),
                                "seconds": time.time() - t0}}


_SETTINGS = ("input", "seq_len", "tokenizer_sha256", "eos_id", "seed", "holdout", "compression", "dtype",
             "packing")
# compared where the old manifest records them (a dataset converted before they were recorded: not compared);
# a narrower --sources removed the other sources' finished parts as if their files were gone
_RECORDED = {"selected_sources": "--sources", "mix": "the mix (--weights/--source-weights/--bucket-upsample)"}


# the temp files of an atomic write of the dataset's marks, left by a kill while publishing
_MARK_TMP = re.compile(r"\.(manifest|index)\.json\..+\.tmp")


def _with_new_buckets(key: str, value):
    """An earlier manifest's ``mix`` with the buckets added since at their defaults (``1001-30000000``):
    the same mix as before, not "converted with other settings"."""
    if key != "mix" or not isinstance(value, dict) or not isinstance(value.get("bucket_upsample"), dict):
        return value
    from megaloop.data.txt360 import DEFAULT_BUCKET_UPSAMPLE

    return {**value, "bucket_upsample": {**DEFAULT_BUCKET_UPSAMPLE, **value["bucket_upsample"]}}


def _refuse_foreign(out: Path, old: dict | None, new: dict) -> None:
    """Without ``--overwrite``, refuse an ``out`` whose dataset was converted from another input or
    with other settings (only changed input *files* update a dataset in place), and a non-empty
    ``out`` that holds no dataset of this tool."""
    ours = {"parts", ".tmp", STAGED, ".lock", "index.json", "manifest.json"}
    if old is None:  # a run killed while publishing left its marks' temp files: ours (they were "foreign")
        foreign = sorted(p.name for p in out.iterdir() if p.name not in ours and not _MARK_TMP.fullmatch(p.name))
        if foreign:
            raise DataError(f"--out {out} is not empty and holds no converted dataset ({foreign[:5]}); "
                            "choose an empty or new folder")
        return
    new = dict(new, packing=new.get("packing", "concat"))
    diff = [f"{k}: {old.get(k, 'concat' if k == 'packing' else None)!r} -> {new.get(k)!r}" for k in _SETTINGS
            if old.get(k, "concat" if k == "packing" else None) != new.get(k)
            and not (k == "input" and Path(str(old.get(k))).resolve() == Path(str(new.get(k))).resolve())]
    diff += [f"{name}: {old[k]!r} -> {new.get(k)!r}" for k, name in _RECORDED.items()
             if k in old and _with_new_buckets(k, old[k]) != new.get(k)]
    if diff:
        raise DataError(f"--out {out} holds a dataset converted with other settings ({'; '.join(diff)}); "
                        "pass --overwrite to replace it, or choose another --out")


def _finished_parts(out: Path, tasks: list[_Task], published: bool) -> tuple[dict[str, dict], list[_Task]]:
    """The tasks' parts already converted with their fingerprint (in ``OUT/.staged/`` from an
    interrupted update, else in ``parts/``), and the tasks left to do. ``published``: a dataset is
    published in ``out``, so new parts go to ``.staged/`` (each task's ``final_dir`` is set so);
    otherwise a staged part found is moved into ``parts/`` at once (an update cut short while it
    published) and new parts go straight there."""
    dones: dict[str, dict] = {}
    todo: list[_Task] = []
    for t in tasks:
        name = t.final_dir.name
        staged, final = out / STAGED / name, out / "parts" / name
        hit = None
        for where in (staged, final):
            d = _load_done(where)
            if d and d.get("fingerprint") == t.fingerprint:
                hit = where, d
                break
        if hit and hit[0] == staged and not published:
            _replace_dir(staged, final, out / ".tmp")
        t.final_dir = staged if published else final
        if hit:
            dones[t.file.part] = hit[1]
        else:
            todo.append(t)
    if published:
        (out / STAGED).mkdir(exist_ok=True)
    else:
        rmtree_quiet(out / STAGED)
    return dones, todo


def _replace_dir(new: Path, final: Path, trash: Path) -> None:
    """Rename ``new`` to ``final``, an old ``final`` first moved into the folder ``trash``."""
    if final.exists():
        os.rename(final, trash / f"old-{uuid.uuid4().hex[:8]}-{final.name}")
    os.rename(new, final)


def _nothing_packed(cfg: ConvertConfig, sources: dict, kept: Path | None = None) -> NothingPackedError:
    """The error when no sequence was packed, with the counts that explain it."""
    tot = {k: sum(v[k] for v in sources.values()) for k in ("docs", "docs_empty", "docs_val", "docs_screen",
                                                            "doc_tokens")}
    zero = sorted(s for s in sources if cfg.mix.source_weights.get(s, 1.0) == 0)
    why = [f"{tot['docs']} training document(s) with {tot['doc_tokens']:,} tokens after mixing"]
    if tot["docs_empty"]:
        why.append(f"{tot['docs_empty']} empty document(s) skipped")
    if tot["docs_val"] or tot["docs_screen"]:
        why.append(f"{tot['docs_val'] + tot['docs_screen']} held out for val/screen")
    if zero:
        why.append(f"source weight 0 for {zero}")
    if cfg.packing == "concat":  # 966 tokens in 40 one-document files fill no 32-token row
        why.append(f"each input file is packed on its own, and a file's tail under {cfg.seq_len} tokens is dropped")
    counts = "; ".join(why)
    what = (f"{kept} keeps the dataset it held" if kept is not None else "no index.json or manifest.json")
    return NothingPackedError(f"no sequence of {cfg.seq_len} tokens could be packed from {cfg.input} ({counts}); "
                              f"nothing was published ({what})", seq_len=cfg.seq_len, counts=counts)


def _load_json(path: Path) -> dict | None:
    import json

    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _run_tasks(todo: list[_Task], cfg: ConvertConfig, tok: Tokenizer, dones: dict[str, dict],
               total: int) -> None:
    """Process ``todo`` inline (1 worker) or in a fork pool, with a progress bar."""
    from tqdm import tqdm

    bar = tqdm(total=total, initial=total - len(todo), unit="file", desc="txt360->mds",
               disable=not cfg.progress, dynamic_ncols=True)
    tokens = 0

    def record(results: Iterator[dict]) -> None:
        nonlocal tokens
        for done in results:
            dones[done["part"]] = done
            tokens += done["stats"]["packed_tokens"]
            bar.update(1)
            bar.set_postfix(tokens=f"{tokens:,}")

    try:
        if cfg.workers <= 1 or len(todo) <= 1:
            global _WORKER_TOK
            _WORKER_TOK = tok
            record(map(_process_part, todo))
        else:
            from megaloop.data._streaming_compat import ensure_streaming_importable

            ensure_streaming_importable()  # import once here; forked workers inherit it
            with ForkPool(min(cfg.workers, len(todo)), _init_worker,
                          (str(tok.path), cfg.eos_token, os.getpid())) as pool:
                record(pool.imap(_process_part, todo, ordered=False, describe=lambda t: str(t.file.path)))
    finally:
        bar.close()
