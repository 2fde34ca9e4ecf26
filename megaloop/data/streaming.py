"""Data-parallel-aware loaders over megaloop MDS datasets (mosaicml-streaming underneath).

Sharding follows the *data-parallel* rank, never the global rank: every process builds its own
``StreamingDataset`` as a one-process "node" (so TP/PP peers of one DP replica, which must read
identical batches, never fight over streaming's per-node shared memory), and its sample partition
is taken from a ``World`` of ``dp_size`` nodes at position ``dp_rank``. streaming's construction
(shared-memory prefix registration) is serialised per machine with a file lock, and its global
``torch.distributed`` barriers are bypassed for it; nothing reads ``RANK``/``WORLD_SIZE``.

Data locations: a local directory of uncompressed shards is read in place; compressed (zstd)
local shards and remote URLs (s3://, gs://, ...) are copied/decompressed by streaming into a
per-process cache slot ``<cache>/streaming/<key>/slot<i>`` (reused across runs; ``cache_limit``
bounds it). A local dataset's shards are checked against ``index.json`` before anything is built
(size always; xxh64 with ``data.validate_hash``, each shard file once per size and mtime); a cached
copy that no longer matches its shard is dropped when a slot is taken; and a shard that fails while
being streamed ends the iteration with one :class:`DataError` naming it (never a hang).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import struct
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from megaloop.config_utils import ConfigError
from megaloop.data._fsutil import file_lock, try_lock_fd
from megaloop.data._streaming_compat import ensure_streaming_importable
from megaloop.data.config import DataConfig
from megaloop.data.dataset_checks import check_cache_dir, default_cache_dir, missing_manifest_hint
from megaloop.data.errors import DataError
from megaloop.data.integrity import refresh_cache_slot, stored_file, verify_shard_hashes

ensure_streaming_importable()

import streaming  # noqa: E402
import streaming.base.dataset as _sd  # noqa: E402
import streaming.base.shared.prefix as _sp  # noqa: E402
import streaming.base.shared as _sh  # noqa: E402
import streaming.base.world as _sw  # noqa: E402
from streaming.base.dataset import _ShardState  # noqa: E402
from streaming.base.shared import SharedMemory as _SharedMemory  # noqa: E402
from streaming.base.world import World  # noqa: E402,F401  (re-exported to loaders)

_PATCH_LOCK = threading.Lock()


def is_remote(path: str) -> bool:
    """True for URLs such as ``s3://bucket/x`` (anything with a scheme)."""
    return "://" in str(path)


class _SoloDist:
    """What streaming sees as torch.distributed while one dataset is constructed."""

    is_available = staticmethod(lambda: True)
    is_initialized = staticmethod(lambda: False)
    barrier = staticmethod(lambda: None)
    get_rank = staticmethod(lambda: 0)
    get_local_rank = staticmethod(lambda: 0)
    get_world_size = staticmethod(lambda: 1)
    get_local_world_size = staticmethod(lambda: 1)


@contextlib.contextmanager
def _solo_construction() -> Iterator[None]:
    """Build a StreamingDataset as a lone process, one construction per machine at a time."""
    # per user: a lock file of another user's (0644 in /tmp) stopped every later user with a PermissionError
    lock = Path(tempfile.gettempdir()) / f"megaloop_streaming_prefix-{os.getuid()}.lock"
    with _PATCH_LOCK, file_lock(lock):
        saved = (_sd.dist, _sp.dist, _sw.dist, _sd.maybe_init_dist, _sp.SharedMemory)
        _sd.dist = _sp.dist = _sw.dist = _SoloDist  # type: ignore[assignment]
        _sd.maybe_init_dist = lambda: False  # type: ignore[assignment]
        _sp.SharedMemory = _probe_without_atexit  # type: ignore[assignment]
        try:
            yield
        finally:
            (_sd.dist, _sp.dist, _sw.dist, _sd.maybe_init_dist,
             _sp.SharedMemory) = saved  # type: ignore[assignment]


def _probe_without_atexit(name: str, create: bool | None = None, size: int = 0,
                          auto_cleanup: bool = True) -> Any:
    """streaming's prefix search attaches to every live prefix's segments with an atexit hook
    that keeps each one open until the process exits: two file descriptors per segment per
    dataset built, which exhausts a 1,024-descriptor limit in a long process (a test session).
    Attaching without the hook lets the probe be closed as soon as it is dropped."""
    return _SharedMemory(name, create, size, auto_cleanup=auto_cleanup and create is not False)


def _shared_segments(state: dict) -> list[Any]:
    """streaming's ``SharedMemory`` objects in a dataset's ``vars()`` (locals, barrier, arrays)."""
    found: list[Any] = []
    stack = list(state.values())
    while stack:
        v = stack.pop()
        if isinstance(v, _SharedMemory):
            found.append(v)
        elif isinstance(v, (_sh.SharedArray, _sh.SharedScalar, _sh.SharedBarrier)):
            stack.extend(vars(v).values())
    return found


# ----------------------------------------------------------------------------------- datasets


def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise DataError(what)
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise DataError(f"{path} is corrupt (invalid JSON: {err.msg})") from None


def _fetch_remote(url: str, name: str, cache_root: Path) -> Path:
    """Download ``url/name`` into the cache (used for manifest.json of remote datasets)."""
    from streaming.base.storage import CloudDownloader

    key = hashlib.sha256(url.encode()).hexdigest()[:16]
    local = cache_root / "remote" / key / name
    local.parent.mkdir(parents=True, exist_ok=True)
    local.unlink(missing_ok=True)
    try:
        CloudDownloader.get(url).download(f"{url.rstrip('/')}/{name}", str(local))
    except Exception as err:
        raise DataError(f"cannot fetch {url.rstrip('/')}/{name}: {err}") from None
    return local


def load_manifest(path: str, cache_dir: str | Path | None = None) -> dict:
    """``manifest.json`` of a dataset directory/URL; errors name the missing/corrupt file."""
    if is_remote(path):
        check_cache_dir(cache_dir)  # the manifest and the shards are copied there
        local = _fetch_remote(path, "manifest.json", Path(cache_dir or default_cache_dir()))
        return _read_json(local, f"{path}/manifest.json is missing")
    d = Path(path)
    if not d.is_dir():
        raise DataError(f"{d} is a file, not a dataset directory" if d.exists()
                        else f"dataset directory {d} does not exist")
    m = d / "manifest.json"
    if not m.is_file():
        hint = missing_manifest_hint(d)
        raise DataError(f"{m} is missing: {d} is not a complete megaloop MDS dataset{hint}")
    return _read_json(m, f"{m} is missing")


def validate_local_shards(path: str | Path) -> dict:
    """Check every shard in ``index.json`` exists with its recorded size; return the index."""
    d = Path(path)
    index_path = d / "index.json"
    index = _read_json(index_path, f"{index_path} is missing (dataset {d} is incomplete)")
    if not sum(int(shard.get("samples") or 0) for shard in index.get("shards", [])):  # streaming: a traceback
        raise DataError(f"dataset {d} is empty: {index_path} lists no samples")  # at the first read (validation)
    for shard in index.get("shards", []):
        infos = [i for i in (shard.get("raw_data"), shard.get("zip_data")) if i]
        present = []
        for info in infos:
            f = d / info["basename"]
            if f.is_file():
                size = f.stat().st_size
                if size == info["bytes"]:
                    break
                present.append(f"{f} is truncated or corrupt: {size} bytes on disk, "
                               f"{index_path} records {info['bytes']}")
        else:
            if present:
                raise DataError(f"MDS shard {present[0]}")
            raise DataError(f"MDS shard {d / infos[-1]['basename']} listed in {index_path} "
                            "is missing")
    return index


TOKEN_DTYPES = ("uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64")  # MDS ndarray dtypes
# what a sequence-length mismatch names: the config field (training) or the caller's length (eval sets)
TRAIN_SEQ_LEN = ("model.seq_len", "the model uses seq_len=")
EVAL_SEQ_LEN = ("seq_len", "the evaluation reads sequences of seq_len=")


def _check_index_seq_len(index: dict, seq_len: int, root: Path, field: tuple[str, str] = TRAIN_SEQ_LEN) -> None:
    """Raise ConfigError naming the shard if its ``tokens`` column is not ``seq_len`` long, and
    :class:`DataError` if it is not a fixed-length integer array at all (a set another tool wrote:
    float tokens were cast silently, rows of another length trained at it, ragged rows crashed)."""
    for shard in index.get("shards", []):
        names, encs = shard.get("column_names", []), shard.get("column_encodings", [])
        enc = dict(zip(names, encs)).get("tokens")
        f = root / (shard.get("zip_data") or shard.get("raw_data") or {}).get("basename", "?")
        parts = (enc or "").split(":")
        if len(parts) != 3 or parts[0] != "ndarray" or parts[1] not in TOKEN_DTYPES or not parts[2].isdigit():
            raise DataError(f"MDS shard {f} stores tokens as {enc!r} (columns {names}); megaloop reads fixed-length "
                            f"integer rows, 'ndarray:<{'|'.join(TOKEN_DTYPES)}>:{seq_len}' (data_prep/txt360_to_mds.py "
                            "writes them)")
        if parts[2] != str(seq_len):
            raise ConfigError(f"{field[0]}: {field[1]}{seq_len} but shard {f} stores tokens as {enc}")


def check_seq_len(manifest: dict, seq_len: int, where: str, field: tuple[str, str] = TRAIN_SEQ_LEN) -> None:
    """Raise ConfigError naming the manifest if its sequence length differs from ``seq_len``;
    ``field``: the option that set ``seq_len`` and how to say it (:data:`TRAIN_SEQ_LEN`)."""
    have = manifest.get("seq_len")
    if have != seq_len:
        fix = f"set {field[0]}={have}" if field is TRAIN_SEQ_LEN and isinstance(have, int) else f"change {field[0]}"
        raise ConfigError(f"{field[0]}: {field[1]}{seq_len} but {where} holds sequences of {have} tokens; "
                          f"rebuild the data at that length or {fix}")


def verify_dataset(path: str, cache_dir: str | Path | None = None, validate_hash: bool = True,
                   part: tuple[int, int] = (0, 1)) -> None:
    """The checks a loader makes of a local dataset's shards before it is built (:func:`validate_local_shards`,
    then :func:`verify_shard_hashes` of ``part``), for a caller that checks once for all its loaders
    (a trainer: every rank hashes its share, then builds them with ``hashes_verified=True``); nothing
    for a remote URL. :class:`DataError` naming the shard."""
    if is_remote(path):
        return
    load_manifest(path, cache_dir)  # first: what a missing or unfinished dataset is named as
    index = validate_local_shards(path)
    if validate_hash:
        verify_shard_hashes(Path(path), index, Path(cache_dir) if cache_dir else default_cache_dir(), part)


class _Source:
    """A resolved dataset: manifest plus how streaming should read it."""

    def __init__(self, path: str, seq_len: int, cache_dir: str | Path | None, *, validate_hash: bool = True,
                 hashes_verified: bool = False, seq_len_field: tuple[str, str] = TRAIN_SEQ_LEN) -> None:
        self.path = path
        self.cache_dir = cache_dir  # as given (None: $MEGALOOP_CACHE or the default), for its check
        self.cache_root = Path(cache_dir) if cache_dir else default_cache_dir()
        self.manifest = load_manifest(path, self.cache_root)
        self.validate_hash = validate_hash
        self.index: dict | None = None  # index.json of a local dataset
        where = f"{path.rstrip('/')}/manifest.json"
        check_seq_len(self.manifest, seq_len, where, seq_len_field)
        if "tokens" not in self.manifest.get("columns", {"tokens": 1}):
            raise DataError(f"{where}: dataset has no 'tokens' column")
        if is_remote(path):
            self.remote: str | None = path
            key_src = path + str(self.manifest.get("fingerprint"))
        else:
            self.index = index = validate_local_shards(path)
            _check_index_seq_len(index, seq_len, Path(path), seq_len_field)
            if validate_hash and not hashes_verified:
                verify_shard_hashes(Path(path), index, self.cache_root)
            compressed = any(s.get("compression") for s in index["shards"])
            self.remote = str(Path(path).resolve()) if compressed else None
            key_src = str(Path(path).resolve()) + json.dumps(index, sort_keys=True)
        self.num_samples = int(self.manifest["num_sequences"])
        if self.num_samples < 1:
            raise DataError(f"dataset {path} is empty: {where} records num_sequences={self.num_samples}")
        self.key = hashlib.sha256(key_src.encode()).hexdigest()[:16]

    def open(self, *, shuffle: bool, shuffle_seed: int, batch_size: int,
             num_canonical_nodes: int, cfg: DataConfig | None) -> tuple[Any, int | None]:
        """Construct the StreamingDataset (solo world); returns it and the held cache-slot fd."""
        fd = None
        if self.remote is None:
            local = str(Path(self.path).resolve())
        else:  # compressed or remote shards are read from copies in the cache (uncompressed local ones are not)
            check_cache_dir(self.cache_dir)
            base = (self.cache_root / "streaming" / self.key).resolve()
            base.mkdir(parents=True, exist_ok=True)
            for i in range(4096):
                fd = try_lock_fd(base / f"slot{i}.lock")
                if fd is not None:
                    local = str(base / f"slot{i}")
                    break
            else:
                raise DataError(f"no free cache slot under {base}")
        kwargs: dict[str, Any] = {}
        if cfg is not None:
            kwargs = {"cache_limit": cfg.cache_limit, "predownload": cfg.predownload,
                      "shuffle_algo": cfg.shuffle_algo,
                      "shuffle_block_size": cfg.shuffle_block_size}
        hashed = self.index is None or all((stored_file(s).get("hashes") or {}).get("xxh64")
                                           for s in self.index.get("shards", []))
        if self.validate_hash and self.remote is not None and hashed:
            kwargs["validate_hash"] = "xxh64"  # checked as each shard is copied into the cache
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        try:
            if fd is not None:  # a slot we hold: copies that no longer match their shard go first
                index = self.index
                if index is None:  # remote: the index streaming copied into the slot, if any
                    with contextlib.suppress(OSError, ValueError):
                        index = json.loads((Path(local) / "index.json").read_text())
                refresh_cache_slot(Path(local), index or {}, None if is_remote(self.path) else Path(self.remote),
                                   check_raw=bool(self.validate_hash))
                with contextlib.suppress(FileNotFoundError):
                    (Path(local) / FAILURE_MARK).unlink()  # an earlier loader's failure
            with _solo_construction():
                if fd is not None:
                    _scrub_stale_registrations(local)
                ds = _Dataset(
                    remote=self.remote, local=local, shuffle=shuffle, shuffle_seed=shuffle_seed,
                    batch_size=batch_size, num_canonical_nodes=num_canonical_nodes, **kwargs)
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise
        if ds.num_samples != self.num_samples:
            raise DataError(f"{self.path}: index.json holds {ds.num_samples} samples but "
                            f"manifest.json says {self.num_samples}")
        return ds, fd


def _damaged_copy(err: BaseException) -> str | None:
    """The cache file named by streaming's ``ValueError("Checksum failure: PATH")``, else None."""
    text = str(err) if isinstance(err, ValueError) else ""
    return text.split("Checksum failure: ", 1)[1] if text.startswith("Checksum failure: ") else None


REMOTE_CLIENTS = ("botocore", "boto3", "google", "azure", "oci", "requests", "urllib3")  # object-store errors
FAILURE_MARK = ".megaloop-failure"  # in a cache slot: a shard failure, for the loader's other worker processes


def _copy_failure(ds: Any, shard_id: int, err: BaseException) -> BaseException:
    """A :class:`DataError` naming the dataset's shard file (and the cache copy) for a failure to
    copy, check or unpack shard ``shard_id`` (an OS, object-store or decompression error, a bad
    checksum, a cache too small for it); ``err`` itself when it is not a data failure (a bug)."""
    module = type(err).__module__.lower()
    data_failure = (isinstance(err, (OSError, ValueError, EOFError)) or "zstd" in module
                    or module.split(".")[0] in REMOTE_CLIENTS)
    if not data_failure or isinstance(err, DataError):
        return err
    stream = ds.streams[ds.stream_per_shard[shard_id]]
    raw, zipped = ds.shards[shard_id].file_pairs[0]
    name = (zipped or raw).basename
    origin = f"{stream.remote.rstrip('/')}/{name}" if stream.remote else str(Path(stream.local) / name)
    first = str(err).splitlines()[0] if str(err) else ""
    if _damaged_copy(err):
        return DataError(f"MDS shard {origin} is corrupt: it failed its xxh64 check against index.json twice "
                         f"while being copied into the cache ({_damaged_copy(err)}; the copies were removed); "
                         "restore the file from a good copy or rebuild the dataset")
    if isinstance(err, ValueError) and "cache limit may be too low" in first:
        return DataError(f"data.cache_limit={ds.cache_limit} bytes is too small to hold shard {origin} in the "
                         f"cache {stream.local} (nothing left to evict); raise data.cache_limit")
    if isinstance(err, ValueError) and first.startswith("Hash algorithm"):
        return DataError(f"data.validate_hash: {origin} has no xxh64 hash in the dataset's index.json to check "
                         "its copy against; set data.validate_hash=false or rebuild the dataset")
    return DataError(f"MDS shard {origin} could not be copied into the cache {stream.local}: "
                     f"{type(err).__name__}: {first}")


class _Dataset(streaming.StreamingDataset):
    """streaming's dataset, with shard failures that end the iteration as one :class:`DataError`.

    In streaming, a shard whose copy failed stays PREPARING, so a reader waiting for it (the main
    thread in ``get_item``) waits for ever; a download thread that raises is never counted as exited,
    so the end of the epoch (``_Iterator.exit``, also run when the loader is closed at exit) waits for
    ever; and a failure in that thread surfaces as "Background thread failed" after a logged
    traceback. Here a cached copy that fails its checksum is deleted and the shard copied once more;
    a second failure (the shard itself is bad) or any other is recorded, the shard is set back to
    REMOTE (waiters wake up), the threads are told to stop and count as exited, and every later read
    raises the recorded error."""

    def _failed(self) -> BaseException | None:
        return self.__dict__.get("_megaloop_failure")

    def _fail(self, shard_id: int | None, failure: BaseException) -> BaseException:
        first = "_megaloop_failure" not in self.__dict__
        self.__dict__.setdefault("_megaloop_failure", failure)
        if shard_id is not None:
            self._unlock(shard_id)
        event = self.__dict__.get("_event")
        if event is not None:
            event.set()
        if first and isinstance(failure, DataError):  # the other worker processes stop too (_watch)
            for stream in self.streams:
                with contextlib.suppress(OSError):
                    (Path(stream.local) / FAILURE_MARK).write_text(str(failure))
        return self._failed()

    def _watch(self, done: threading.Event) -> None:
        """Until ``done``: stop this process's threads when another process of the loader recorded a
        shard failure in the cache slot (a ready thread waiting for a shard that another worker
        process failed to copy watches only its own process' stop event)."""
        marks = [Path(stream.local) / FAILURE_MARK for stream in self.streams]
        while not done.wait(0.2):
            for mark in marks:
                with contextlib.suppress(OSError):
                    if mark.is_file():
                        self._fail(None, DataError(mark.read_text().strip()))
                        return

    def _unlock(self, shard_id: int) -> None:
        if self._shard_states[shard_id] == _ShardState.PREPARING:
            self._shard_states[shard_id] = _ShardState.REMOTE

    def prepare_shard(self, shard_id: int, blocking: bool = True) -> None:
        for again in (False, True):
            if self._failed() is not None:
                raise self._failed()
            try:
                return super().prepare_shard(shard_id, blocking)
            except Exception as err:  # noqa: BLE001 - named in _copy_failure, re-raised otherwise
                damaged = _damaged_copy(err)
                if damaged:  # a copy that failed its check is never kept
                    with contextlib.suppress(OSError):
                        os.unlink(damaged)
                    if not again:  # copy the shard once more
                        self._unlock(shard_id)
                        continue
                failure = _copy_failure(self, shard_id, err)
                if failure is err:  # not a data failure: the error itself, with its traceback
                    self._fail(shard_id, err)
                    raise
                raise self._fail(shard_id, failure) from None

    def get_item(self, sample_id: int, retry: int = 7) -> Any:
        if self._failed() is not None:
            raise self._failed()
        try:
            return super().get_item(sample_id, retry)
        except DataError:
            raise
        except (ValueError, IndexError, KeyError, EOFError, struct.error) as err:  # e.g. UnicodeDecodeError
            # a sample that does not decode: a shard damaged in place (data.validate_hash=false reads it
            # unchecked); it was the decoder's traceback
            shard_id, _ = self.spanner[sample_id]
            stream = self.streams[self.stream_per_shard[shard_id]]
            raw, zipped = self.shards[shard_id].file_pairs[0]
            origin = f"{stream.remote.rstrip('/')}/{(zipped or raw).basename}" if stream.remote else \
                str(Path(stream.local) / raw.basename)
            raise self._fail(None, DataError(
                f"MDS shard {origin}: sample {sample_id} cannot be decoded ({type(err).__name__}: "
                f"{str(err).splitlines()[0][:160] if str(err) else ''}); the file is damaged (with "
                "data.validate_hash=true its hash check names it before training)")) from None

    def _prepare_thread(self, it: Any) -> None:
        try:
            super()._prepare_thread(it)
        except BaseException:
            it.on_exit()  # streaming counts only threads that return: exit() would wait for ever
            raise

    def _ready_thread(self, it: Any) -> None:
        try:
            super()._ready_thread(it)
        except BaseException:
            it.on_exit()
            raise

    def on_exception(self, future: Any) -> None:
        """A download thread's failure: recorded for the reader (no logged traceback)."""
        exc = future.exception()
        if exc is not None:
            self._fail(None, exc)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self._failed() is not None:
            raise self._failed()
        done = threading.Event()
        if any(stream.remote for stream in self.streams):  # only copies into the cache can fail
            threading.Thread(target=self._watch, args=(done,), daemon=True, name="megaloop-shard-watch").start()
        try:
            yield from super().__iter__()
        finally:
            done.set()
        if self._failed() is not None:  # streaming ends the epoch early when a thread failed
            raise self._failed()


def _scrub_stale_registrations(local: str) -> None:
    """Forget streaming's shared-memory registrations of ``local`` left by dead owners.

    We hold the cache slot's lock, so no live dataset uses ``local``; a registration that names
    it belongs to a closed loader or a crashed process and would make streaming refuse the slot.
    """
    from streaming.base.shared import SharedMemory

    tmp = tempfile.gettempdir()
    for prefix in range(100_000):
        try:
            shm = SharedMemory(f"{prefix:06}_locals", False, auto_cleanup=False)
        except FileNotFoundError:
            if not any(os.path.exists(os.path.join(tmp, f"{prefix:06}_{n}"))
                       for n in ("barrier_filelock", "cache_filelock")):
                return
            continue
        except PermissionError:
            continue
        size = int(np.frombuffer(bytes(shm.buf[:4]), np.int32)[0])
        names = bytes(shm.buf[4:size]).decode("utf-8", "replace").split("\0")[:-1] if size else []
        if local in names:
            shm.buf[:4] = np.int32(0).tobytes()
        shm.shm.close()


def _release(fd: int | None, prefix: int | None, state: dict | None = None) -> None:
    """Free a cache slot, one dataset's shared-memory segments and its leftover file locks.

    ``state`` is the dataset's ``vars()``: its segments are closed, and unlinked where the
    dataset created them; streaming itself only does that at process exit, so a process that
    builds many loaders would otherwise keep every one's segments (and descriptors) to the end.
    Its exit-time clean-up of them is then dropped, so it cannot unlink a later loader's segments
    that reuse the names."""
    state = state or {}
    locals_shm = state.get("_locals_shm")
    if locals_shm is not None:  # unregister the local dir first (what the dataset's __del__ does)
        with contextlib.suppress(Exception):
            locals_shm.buf[:4] = np.int32(0).tobytes()
    for seg in _shared_segments(state):
        with contextlib.suppress(Exception):
            seg.cleanup()
        # streaming registered the same clean-up with atexit: run then, it would unlink by name the
        # segments a later loader (here or in another process) created under these names since
        atexit.unregister(seg.cleanup)
        seg.created_shms, seg.opened_shms = [], []
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
    if prefix is not None:
        for name in ("barrier_filelock", "cache_filelock"):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(tempfile.gettempdir(), f"{prefix:06}_{name}"))


def make_batch(tokens: torch.Tensor, eos_id: int, mask_document_boundaries: bool,
               num_tokens: torch.Tensor | None = None) -> dict:
    """``tokens`` [b, s] int64 -> dict(tokens, labels [b, s] int64, loss_mask [b, s] float32).

    ``labels[:, i] = tokens[:, i+1]``; the last position has no target (label eos, mask 0). With
    boundary masking, positions whose *input* is EOS (target = next document's first token) get 0.
    ``num_tokens`` [b] (rows of ``--packing whole`` datasets: real tokens, then padding): positions
    ``i >= num_tokens - 1`` (target or input is padding) get 0.
    """
    labels = torch.empty_like(tokens)
    labels[:, :-1] = tokens[:, 1:]
    labels[:, -1] = eos_id
    loss_mask = torch.ones(tokens.shape, dtype=torch.float32)
    loss_mask[:, -1] = 0.0
    if mask_document_boundaries:
        loss_mask[tokens == eos_id] = 0.0
    if num_tokens is not None:
        pos = torch.arange(tokens.shape[1])[None, :]
        loss_mask[pos >= num_tokens.to(torch.long)[:, None] - 1] = 0.0
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask}


class _Collate:
    """Samples -> a batch (:func:`make_batch`). ``vocab_size`` (the manifest's): token ids outside
    ``[0, vocab_size)`` are a :class:`DataError` naming ``where`` (they were an ``IndexError`` in the
    embedding at the first step, a device-side assert on a GPU)."""

    def __init__(self, eos_id: int, mask_doc: bool, with_source: bool = False, *, vocab_size: int | None = None,
                 where: str = "") -> None:
        self.eos_id, self.mask_doc, self.with_source = eos_id, mask_doc, with_source
        self.vocab_size, self.where = vocab_size, where

    def __call__(self, samples: list) -> dict:
        valid = None
        if isinstance(samples[0], tuple):  # eval items: (sample, is_real)
            valid = torch.tensor([ok for _, ok in samples], dtype=torch.float32)
            samples = [s for s, _ in samples]
        arr = np.stack([np.asarray(s["tokens"]) for s in samples]).astype(np.int64)
        if self.vocab_size and arr.size and (arr.max() >= self.vocab_size or arr.min() < 0):
            bad = int(arr.max()) if arr.max() >= self.vocab_size else int(arr.min())
            raise DataError(f"dataset {self.where}: token id {bad} outside the vocabulary [0, {self.vocab_size}) its "
                            "manifest.json records (vocab_size): a damaged shard (data.validate_hash=true checks "
                            "the files) or a manifest that understates the tokenizer's vocabulary")
        counts = None  # whole-document packing: real tokens per row, padding after them
        if samples[0].get("num_tokens") is not None:
            counts = torch.tensor([int(s["num_tokens"]) for s in samples], dtype=torch.long)
        batch = make_batch(torch.from_numpy(arr), self.eos_id, self.mask_doc, counts)
        if valid is not None:
            batch["loss_mask"] *= valid[:, None]
        if self.with_source:
            batch["source"] = [s.get("source", "") for s in samples]
        return batch


def samples_per_rank(num_samples: int, num_canonical_nodes: int, dp_size: int) -> int:
    """Samples one DP rank gets per epoch under streaming's partitioning (incl. its padding)."""
    spc = -(-num_samples // num_canonical_nodes)
    if num_canonical_nodes < dp_size:
        ratio = dp_size // num_canonical_nodes
        spc += (ratio - spc % ratio) % ratio
    return num_canonical_nodes * spc // dp_size
