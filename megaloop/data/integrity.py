"""Shard integrity: MDS shard files checked against the xxh64 hashes their ``index.json`` records,
and cached copies that no longer match their shard dropped (so streaming copies them again).

Pure file checks (no streaming import): :mod:`megaloop.data.streaming` calls them before it builds
a dataset."""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
from pathlib import Path
from typing import Iterator

import xxhash

from megaloop.data._fsutil import atomic_write_json, file_lock
from megaloop.data.errors import DataError

NOTE_HASH_BYTES = 1 << 30  # say so on stderr before hashing more than this at start-up


def xxh64_file(path: Path) -> str:
    """The xxh64 hex digest of a file (what streaming's writer records in ``index.json``)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, xxhash.xxh64).hexdigest()


def stored_file(shard: dict) -> dict:
    """The file info of what a dataset directory stores for ``shard`` (the zip, else the raw file)."""
    return shard.get("zip_data") or shard.get("raw_data") or {}


def verify_shard_hashes(root: Path, index: dict, cache_root: Path, part: tuple[int, int] = (0, 1)) -> None:
    """Check each shard file under ``root`` against the xxh64 that ``index.json`` records for it
    (shards without one are skipped): :class:`DataError` naming the first that differs. ``part``
    ``(i, n)``: only every n-th shard from the i-th (n processes of a job share the reading). A shard
    verified before with the same size and mtime is not read again (the verified ones are listed in
    ``<cache>/verified/<key>.json``; processes on one machine take turns, so a shard is read once)."""
    i, n = part
    if not (n >= 1 and 0 <= i < n):
        raise ValueError(f"part: expected (i, n) with 0 <= i < n, got {part}")
    todo = []
    for shard in index.get("shards", [])[i::n]:
        on_disk = [f for f in (shard.get("zip_data"), shard.get("raw_data")) if f and (root / f["basename"]).is_file()]
        if on_disk and (on_disk[0].get("hashes") or {}).get("xxh64"):
            todo.append((on_disk[0]["basename"], on_disk[0]["hashes"]["xxh64"]))
    if not todo:
        return
    stamp: Path | None = cache_root / "verified" / f"{hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:16]}.json"
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only cache: verify without remembering
        stamp = None

    @contextlib.contextmanager
    def locked() -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if stamp is not None:
                with contextlib.suppress(OSError):  # a lock file that cannot be made: unlocked
                    stack.enter_context(file_lock(stamp.with_suffix(".lock")))
            yield

    def read() -> dict:
        try:
            seen = json.loads(stamp.read_text()) if stamp is not None else {}
        except (OSError, ValueError):
            seen = {}
        return seen if isinstance(seen, dict) else {}

    # alone (n == 1), processes on one machine take turns, so one of them reads each shard; a share of
    # a job's shards (n > 1) is read without the lock, taken only to read and update the list
    briefly = locked if n > 1 else contextlib.nullcontext
    with locked() if n == 1 else contextlib.nullcontext():
        with briefly():
            seen = read()
        ok: dict[str, list] = {}
        pending = []
        for name, want in todo:
            try:
                st = (root / name).stat()
            except OSError as err:
                raise DataError(f"MDS shard {root / name} cannot be read: {err.strerror or err}") from None
            key = [st.st_size, st.st_mtime_ns, want]
            if seen.get(name) == key:
                ok[name] = key
            else:
                pending.append((name, want, key))
        total = sum(k[0] for _, _, k in pending)
        if total > NOTE_HASH_BYTES and i == 0:  # one line per machine
            share = f" (each of {n} processes about that much)" if n > 1 else ""
            print(f"note: verifying {len(pending)} shards ({total / 2**30:.1f} GiB) of {root}{share} against the "
                  "xxh64 hashes in its index.json (once per shard file; data.validate_hash=false skips it)",
                  file=sys.stderr, flush=True)
        try:
            for name, want, key in pending:
                try:
                    got = xxh64_file(root / name)
                except OSError as err:
                    raise DataError(f"MDS shard {root / name} cannot be read: {err.strerror or err}") from None
                if got != want:
                    raise DataError(f"MDS shard {root / name} is corrupt: its content does not match "
                                    f"{root / 'index.json'} (xxh64 {got}, recorded {want}); restore the file "
                                    "from a good copy or rebuild the dataset")
                ok[name] = key
        finally:
            if stamp is not None and pending:
                with contextlib.suppress(OSError), briefly():  # what others verified meanwhile stays listed
                    atomic_write_json(stamp, {**read(), **ok})


def refresh_cache_slot(slot: Path, index: dict, source: Path | None, check_raw: bool = False) -> list[Path]:
    """Drop the copies in cache slot ``slot`` that no longer match their shard, so streaming copies
    them again instead of reusing them: a compressed copy (streaming deletes one once unpacked, so a
    left one was cut short or failed its check) whose size or xxh64 differs from ``index.json``, an
    unpacked one of another size, or (``check_raw``: ``data.validate_hash``) whose xxh64 differs from
    the raw hash ``index.json`` records (a damaged copy was trained on silently, and a badly damaged
    one failed every later run blaming the intact shard; each copy is hashed once per size and mtime,
    listed in ``slot/.megaloop-verified.json``), and (``source``: the local dataset directory) any
    copy older than its shard file there (the file was replaced since). Returns what was removed."""
    dropped = []
    memo_path = slot / ".megaloop-verified.json"
    try:
        memo = json.loads(memo_path.read_text()) if check_raw else {}
    except (OSError, ValueError):
        memo = {}
    memo = memo if isinstance(memo, dict) else {}
    seen = dict(memo)
    if check_raw:  # say so before hashing much (as the shards' own check does)
        todo = sum(int(r.get("bytes") or 0) for sh in index.get("shards", []) if (r := sh.get("raw_data"))
                   and (slot / r["basename"]).is_file() and r["basename"] not in memo)
        if todo > NOTE_HASH_BYTES:
            print(f"note: verifying {todo / 2**30:.1f} GiB of unpacked copies in {slot} against index.json's xxh64 "
                  "(once per copy; data.validate_hash=false skips it)", file=sys.stderr, flush=True)
    for shard in index.get("shards", []):
        zinfo, rinfo = shard.get("zip_data"), shard.get("raw_data")
        origin = source / stored_file(shard)["basename"] if source is not None and stored_file(shard) else None
        try:
            newer = origin.stat().st_mtime_ns if origin is not None else None
        except OSError:
            newer = None
        for info, check_hash in ((zinfo, True), (rinfo, check_raw)):
            if not info:
                continue
            f = slot / info["basename"]
            try:
                st = f.stat()
            except OSError:
                continue
            want = (info.get("hashes") or {}).get("xxh64") if check_hash else None
            key = [st.st_size, st.st_mtime_ns, want]
            if want and info is rinfo and memo.get(info["basename"]) == key:
                want = None  # this copy, unchanged since it was hashed
            if (st.st_size != info.get("bytes") or (newer is not None and newer > st.st_mtime_ns)
                    or (want and xxh64_file(f) != want)):
                seen.pop(info["basename"], None)
                with contextlib.suppress(OSError):
                    f.unlink()
                    dropped.append(f)
            elif info is rinfo and key[2]:
                seen[info["basename"]] = key
    if check_raw and seen != memo:
        with contextlib.suppress(OSError):
            atomic_write_json(memo_path, seen)
    return dropped
