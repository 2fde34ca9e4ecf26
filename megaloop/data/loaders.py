"""Train / eval loaders: the public entry points the trainer calls.

``build_train_loader`` -> infinite, shuffled, resumable stream of micro-batches for one DP rank;
``build_eval_loader`` -> finite, ordered micro-batches covering every eval sample exactly once
across DP ranks (padding rows carry ``loss_mask`` 0 so every rank runs the same number of batches).
Batches: ``tokens`` / ``labels`` LongTensor [b, seq_len], ``loss_mask`` FloatTensor [b, seq_len].
Datasets converted with ``--packing whole`` (documents never cross a row) store each row's real
token count; ``loss_mask`` is 0 wherever the input or the target is padding (no config needed: the
dataset says how it was packed, ``manifest.json["packing"]``).
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Dataset

from megaloop.config_utils import ConfigError, require
from megaloop.data.config import EMBEDDED_SPLITS, DataConfig, embedded_split
from megaloop.data.errors import DataError
from megaloop.data.streaming import EVAL_SEQ_LEN, World, _Collate, _release, _Source, samples_per_rank
from megaloop.runtime.exits import start_shielded

STATE_VERSION = 1


def resolve_data_path(path: str, seq_len: int, cache_dir: str | None, split: str) -> str:
    """``default`` / ``default:<split>`` -> the embedded dataset's directory (built in the cache, which
    is checked first: :func:`~megaloop.data.dataset_checks.check_cache_dir`); else unchanged."""
    name = embedded_split(path, split)
    if name is not None:
        from megaloop.data.dataset_checks import check_cache_dir
        from megaloop.data.default_corpus import ensure_default_dataset

        check_cache_dir(cache_dir)

        require(name in EMBEDDED_SPLITS, "data.path", f"unknown embedded split {name!r} ({', '.join(EMBEDDED_SPLITS)})")
        return str(ensure_default_dataset(cache_dir=cache_dir, seq_len=seq_len) / name)
    return path


def sample_order(data: dict) -> dict[str, Any]:
    """The settings of a ``data`` config (a dict) that, with the seed, fix the sample order:
    ``shuffle``, and with it ``shuffle_algo`` and ``shuffle_block_size`` (its defaults for those missing)."""
    if not data.get("shuffle", DataConfig.shuffle):
        return {"shuffle": False}
    return {"shuffle": True, "shuffle_algo": data.get("shuffle_algo", DataConfig.shuffle_algo),
            "shuffle_block_size": data.get("shuffle_block_size", DataConfig.shuffle_block_size)}


def _yaml(value: Any) -> str:
    """``value`` as a dotlist override writes it (true, null, py1e, 100)."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _short(fingerprint: Any) -> str:
    """A fingerprint as its first 12 hex digits (``none`` when absent)."""
    return f"{fingerprint[:12]}…" if isinstance(fingerprint, str) and fingerprint else "none"


def _check_dp(dp_rank: int, dp_size: int, micro_batch_size: int) -> None:
    require(dp_size >= 1, "dp_size", f"must be >= 1, got {dp_size}")
    require(0 <= dp_rank < dp_size, "dp_rank", f"must be in [0, {dp_size}), got {dp_rank}")
    require(micro_batch_size >= 1, "micro_batch_size", f"must be >= 1, got {micro_batch_size}")


def _stop_streaming(ds: Any, release: Any) -> None:
    """Stop streaming's download threads of ``ds`` (workers=0), then ``release`` its resources.

    Those threads hold the dataset, so without this a dropped loader's dataset (its shared
    memory and file descriptors) would live to the end of the process. The stop event first: the
    ready thread waits for a shard that is not yet local without looking at ``exit()``."""
    event = ds.__dict__.get("_event")
    if event is not None:
        event.set()
    it = ds.__dict__.get("_iterator")
    if it is not None:
        it.exit()
    pool = ds.__dict__.pop("_executor", None)
    if pool is not None:
        pool.shutdown(wait=True)
    release()


def _batches(it: Iterator[dict]) -> Iterator[dict]:
    """``it``'s batches; a :class:`DataError` raised in a DataLoader worker (torch re-raises it as
    "Caught DataError in DataLoader worker process N" plus the worker's traceback) as its own line."""
    while True:
        try:
            batch = next(it)
        except StopIteration:
            return
        except DataError as err:
            text = str(err)
            if "Original Traceback" not in text:
                raise
            last = [ln for ln in text.splitlines() if ln.strip()][-1]
            raise DataError(last.split("Error: ", 1)[-1]) from None
        yield batch


def _shutdown(it: Any) -> None:
    """Stop a DataLoader iterator's worker processes now (not at garbage collection). A worker still
    alive after torch's stop (sentinel, join, then SIGTERM, which workers keep blocked: see
    :func:`~megaloop.runtime.exits.start_shielded`) is stuck: it gets SIGKILL."""
    stop = getattr(it, "_shutdown_workers", None)
    if stop is not None:
        stop()
    for w in getattr(it, "_workers", ()):
        if w.is_alive():
            w.kill()
            w.join(5)


class TrainLoader:
    """Infinite iterator of micro-batches for one data-parallel rank, exactly resumable.

    ``state_dict()`` records the epoch and the global number of samples consumed in it (batches
    handed out x micro_batch_size x dp_size); ``load_state_dict()`` makes the next iteration
    yield exactly the batches an uninterrupted run would have yielded next. The state is the same
    on every rank.
    """

    def __init__(self, cfg: DataConfig, *, seq_len: int, micro_batch_size: int, dp_rank: int,
                 dp_size: int, seed: int, hashes_verified: bool = False) -> None:
        _check_dp(dp_rank, dp_size, micro_batch_size)
        self.cfg = cfg
        self.path = resolve_data_path(cfg.path, seq_len, cfg.cache_dir, "train")
        self.seq_len, self.micro_batch_size = seq_len, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.shuffle_seed = (cfg.shuffle_seed + seed) % (1 << 31)
        src = _Source(self.path, seq_len, cfg.cache_dir, validate_hash=cfg.validate_hash,
                      hashes_verified=hashes_verified)
        self.manifest: dict = src.manifest
        self.num_samples = src.num_samples
        ncn = cfg.num_canonical_nodes or dp_size
        require(ncn % dp_size == 0 or dp_size % ncn == 0, "data.num_canonical_nodes",
                f"{ncn} and dp_size={dp_size}: one must divide the other")
        require(self.num_samples >= ncn, "data.num_canonical_nodes",
                f"{ncn} exceeds the {self.num_samples} samples of {self.path}")
        self.num_canonical_nodes = ncn
        self.initial_dp_size = dp_size
        self.batches_per_epoch = samples_per_rank(self.num_samples, ncn, dp_size) // micro_batch_size
        if self.batches_per_epoch < 1:
            raise ConfigError(f"data.path: {self.path} has {self.num_samples} sequences, too few "
                              f"for one micro-batch of {micro_batch_size} on each of {dp_size} "
                              "data-parallel ranks")
        self._ds, fd = src.open(shuffle=cfg.shuffle, shuffle_seed=self.shuffle_seed,
                                batch_size=micro_batch_size, num_canonical_nodes=ncn, cfg=cfg)
        # This rank's view for partitioning: node dp_rank of dp_size one-rank nodes.
        self._ds._parallel_rank_world = World(num_nodes=dp_size, ranks_per_node=1,
                                              workers_per_rank=1, worker=dp_rank)
        self._ds.length = -(-self._ds.epoch_size // dp_size)
        self._finalizer = weakref.finalize(self._ds, _release, fd, self._ds._shm_prefix_int,
                                           vars(self._ds))
        self._closer = weakref.finalize(self, _stop_streaming, self._ds, self._finalizer)
        self._collate = _Collate(int(self.manifest["eos_id"]), cfg.mask_document_boundaries,
                                 vocab_size=self.manifest.get("vocab_size"), where=str(self.path))
        self._epoch = 0
        self._base_samples = 0  # global samples consumed in this epoch before _batches
        self._batches = 0  # batches handed out since the last (re)start of this epoch
        self._generation = 0
        self._active: Any = None  # the running DataLoader iterator, if any
        self.rebuilt = False  # resumed on a rebuild of the saved dataset (load_state_dict)

    # -- state -------------------------------------------------------------------------------
    def _samples_in_epoch(self) -> int:
        return self._base_samples + self._batches * self.micro_batch_size * self.dp_size

    def state_dict(self) -> dict[str, Any]:
        """JSON-able resume state (identical on every DP rank)."""
        return {"version": STATE_VERSION, "epoch": self._epoch,
                "sample_in_epoch": self._samples_in_epoch(),
                "num_canonical_nodes": self.num_canonical_nodes, "shuffle_seed": self.shuffle_seed,
                "order": self._order(),
                "initial_dp_size": self.initial_dp_size,
                "dataset_fingerprint": self.manifest.get("fingerprint"),
                "dataset_content_sha256": self.content_sha256(),
                "num_samples": self.num_samples}

    def _order(self) -> dict[str, Any]:
        return sample_order(vars(self.cfg))

    def content(self) -> dict | None:
        """The dataset's :func:`~megaloop.data.fingerprint.content_fingerprint` (None for a remote
        dataset), computed once: the checkpoints' resume check and the run's ``data.json`` share it."""
        if not hasattr(self, "_content"):
            from megaloop.data.fingerprint import content_fingerprint

            self._content = content_fingerprint(self.path)
        return self._content

    def content_sha256(self) -> str | None:
        """The shards' content hash; None for a remote dataset or one too large to hash without
        recorded shard hashes."""
        fp = self.content()
        return fp["sha256"] if fp and fp.get("hashed") else None

    def load_state_dict(self, sd: dict[str, Any], recorded_content: str | None = None) -> None:
        """Resume: the next ``iter(self)`` continues exactly after the saved position. A dataset rebuilt
        since the save (another build fingerprint: the converter hashes its inputs' sizes and mtimes)
        is accepted when its shards' content equals the saved one (``dataset_content_sha256``, or
        ``recorded_content`` for states saved before it was kept: the run's ``data.json``);
        ``self.rebuilt`` says so."""
        if sd.get("version") != STATE_VERSION:
            raise DataError(f"data loader state has version {sd.get('version')}, "
                            f"expected {STATE_VERSION}")
        saved_fp, fp = sd.get("dataset_fingerprint"), self.manifest.get("fingerprint")
        if sd.get("num_samples") != self.num_samples:
            raise DataError(f"data loader state was saved on a different dataset than {self.path} "
                            f"({sd.get('num_samples')} vs {self.num_samples} samples): resume on the data the run "
                            "trained on, or start a new run from its weights (train.init_weights=CHECKPOINT)")
        saved_content = sd.get("dataset_content_sha256") or recorded_content
        now = self.content_sha256() if saved_content else None
        self.rebuilt = saved_fp != fp and saved_content is not None and saved_content == now
        if saved_fp != fp and not self.rebuilt:  # same size, other content or build settings
            why = ("and other shard content" if saved_content and now else
                   "and the shards' content could not be compared")
            raise DataError(f"data loader state was saved on a different dataset than {self.path}: the same "
                            f"number of samples ({self.num_samples}) but another dataset fingerprint (saved "
                            f"{_short(saved_fp)}, {self.path} has {_short(fp)}; its manifest.json "
                            f"'fingerprint') {why}: resume on the data the run trained on, or start a new run "
                            "from its weights (train.init_weights=CHECKPOINT)")
        if saved_fp == fp and saved_content and now and saved_content != now:  # edited after the conversion
            raise DataError(f"data loader state was saved on a different dataset than {self.path}: the same manifest "
                            f"fingerprint ({_short(fp)}) but other content (shards and index.json: saved sha256 "
                            f"{_short(saved_content)}, now {_short(now)}), so the saved position would point into "
                            "another sample order: resume on the data the run trained on, or start a new run from its weights "
                            "(train.init_weights=CHECKPOINT)")
        saved_order, order = sd.get("order"), self._order()  # no saved order (older states): the trainer adds
        if saved_order is not None and saved_order != order:  # the one of the checkpoint's saved config
            keys = ("shuffle",) if saved_order.get("shuffle") != order["shuffle"] else \
                ("shuffle_algo", "shuffle_block_size")  # (the last two only matter when both shuffle)
            diffs = [f"data.{k}={_yaml(saved_order.get(k))} (this run: {_yaml(order.get(k))})"
                     for k in keys if saved_order.get(k) != order.get(k)]
            keep = " ".join(f"data.{k}={_yaml(v)}" for k, v in saved_order.items())
            raise DataError(f"data loader state was saved with {', '.join(diffs)}: its position in the epoch "
                            f"counts samples in that order, so another one would repeat some and skip others; "
                            f"resume with {keep}, or start a new run")
        self._epoch = int(sd["epoch"])
        self._base_samples = int(sd["sample_in_epoch"])
        self._batches = 0
        self.num_canonical_nodes = int(sd["num_canonical_nodes"])
        if self.cfg.num_canonical_nodes not in (None, self.num_canonical_nodes):  # it was ignored, while
            raise DataError(  # config.yaml recorded it: a re-run of that file trained another order
                f"data loader state: the checkpoint's sample order uses {self.num_canonical_nodes} canonical nodes "
                f"(this run: data.num_canonical_nodes={self.cfg.num_canonical_nodes}); resume with "
                f"data.num_canonical_nodes={self.num_canonical_nodes} (or null: the checkpoint's), or start a new run")
        self.shuffle_seed = int(sd["shuffle_seed"])
        self.initial_dp_size = int(sd["initial_dp_size"])
        ncn = self.num_canonical_nodes
        require(ncn % self.dp_size == 0 or self.dp_size % ncn == 0, "data.num_canonical_nodes",
                f"the checkpoint's sample order uses {ncn} canonical nodes, which does not fit "
                f"dp_size={self.dp_size} (one must divide the other)")
        self.batches_per_epoch = (samples_per_rank(self.num_samples, ncn, self.dp_size)
                                  // self.micro_batch_size)
        pos = self._base_samples  # (at or past this size's last full step the epoch is over: nothing repeats)
        usable = self.batches_per_epoch * self.micro_batch_size * self.dp_size
        if pos % self.dp_size and pos < usable:  # streaming rounds the offset down: samples trained twice
            fits = [d for d in range(1, 65) if pos % d == 0 and (ncn % d == 0 or d % ncn == 0)]
            raise DataError(f"data loader state: the checkpoint's position in epoch {self._epoch} is sample {pos}, "
                            f"which data-parallel size {self.dp_size} does not divide (streaming would start at "
                            f"sample {pos - pos % self.dp_size} and train {pos % self.dp_size} sample(s) twice); "
                            f"resume at a data-parallel size that divides it and fits its {ncn} canonical nodes "
                            f"({', '.join(map(str, fits[:8]))}{', ...' if len(fits) > 8 else ''}), or keep the "
                            "checkpoint's size to the end of the epoch (the next one starts at sample 0)")
        self._generation += 1  # invalidate running iterators

    @property
    def epoch(self) -> int:
        """Current epoch (0-based)."""
        return self._epoch

    # -- iteration ---------------------------------------------------------------------------
    def _dataloader(self) -> DataLoader:
        """A DataLoader whose iteration starts exactly at (epoch, sample_in_epoch)."""
        ds = self._ds
        ds.next_epoch = self._epoch  # streaming's epoch counter (shared with its workers)
        ds.num_canonical_nodes = self.num_canonical_nodes
        ds.shuffle_seed = self.shuffle_seed
        ds.initial_physical_nodes = self.initial_dp_size
        if self._samples_in_epoch():
            # Mid-epoch start: streaming reads the offset from its resume shared memory.
            ds.load_state_dict({
                "epoch": self._epoch, "sample_in_epoch": self._samples_in_epoch(),
                "num_canonical_nodes": self.num_canonical_nodes,
                "shuffle_seed": self.shuffle_seed, "initial_physical_nodes": self.initial_dp_size})
        nw = self.cfg.num_workers
        return DataLoader(ds, batch_size=self.micro_batch_size, num_workers=nw,
                          collate_fn=self._collate, drop_last=True, persistent_workers=False,
                          prefetch_factor=self.cfg.prefetch_factor if nw else None,
                          pin_memory=torch.cuda.is_available())  # async host-to-device copies

    def _drop_resume(self) -> None:
        """Unlink streaming's resume record once read (it re-opens, and leaks, it every epoch)."""
        shm = self._ds.__dict__.pop("_resume_shm", None)
        if shm is not None:
            shm.cleanup()

    def warm(self) -> None:
        """Read the next batch now, so that a shard that cannot be read fails here (a one-line
        :class:`DataError`), e.g. before a trainer writes its run directory; the next ``iter(self)``
        hands it out first. The state (``state_dict``) does not count it until then."""
        old = self.__dict__.pop("_warm", None)
        if old is not None:  # warmed twice: the first read is dropped (and its workers stopped)
            old[1].close()
        it = self._iterate()
        batch = next(it)
        self._batches -= 1  # fetched, not handed out
        self._warm = (self._generation, it, batch)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        warm = self.__dict__.pop("_warm", None)
        if warm is not None and warm[0] == self._generation:  # no load_state_dict since warm()
            _, it, batch = warm
            self._batches += 1
            yield batch
            yield from it
            return
        if warm is not None:
            warm[1].close()
        yield from self._iterate()

    def _iterate(self) -> Iterator[dict[str, torch.Tensor]]:
        self._generation += 1
        gen = self._generation
        while True:
            loader = self._dataloader()
            it = self._active = start_shielded(lambda: iter(loader))  # workers outlive a group stop signal
            try:
                for batch in _batches(it):
                    # Every streaming worker has read the resume record before any batch exists.
                    self._drop_resume()
                    if gen != self._generation:
                        return
                    self._batches += 1
                    yield batch
            finally:
                self._active = None
                _shutdown(it)
            self._drop_resume()
            if gen != self._generation:
                return
            self._epoch += 1
            self._base_samples = 0
            self._batches = 0

    def close(self) -> None:
        """Stop workers, release the cache slot and streaming's file locks (also at GC/exit).

        The loader is unusable afterwards."""
        warm = self.__dict__.pop("_warm", None)
        if warm is not None:  # a warm() batch never handed out: its iteration ends here
            warm[1].close()
        self._generation += 1
        _shutdown(self._active)
        self._active = None
        self._closer()


class _EvalItems(Dataset):
    """Map-style view: item j -> (sample at index[j], is_real)."""

    def __init__(self, ds: Any, indices: list[int], real: list[bool]) -> None:
        self.ds, self.indices, self.real = ds, indices, real

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, j: int) -> tuple[dict, bool]:
        return self.ds[self.indices[j]], self.real[j]


class EvalLoader:
    """Finite, ordered micro-batches of an eval set for one DP rank.

    Rank ``r`` reads the contiguous slice ``[r*N//P, (r+1)*N//P)`` of the N samples; every rank
    yields ``num_batches = ceil(ceil(N/P)/b)`` full batches, padding with masked rows (loss_mask
    0), so collectives per batch stay in lock-step and each sample counts exactly once.
    """

    def __init__(self, path: str, *, seq_len: int, micro_batch_size: int, dp_rank: int,
                 dp_size: int, cache_dir: str | None = None, num_workers: int = 0,
                 mask_document_boundaries: bool = False, with_source: bool = False,
                 indices: Sequence[int] | None = None, validate_hash: bool = True,
                 hashes_verified: bool = False) -> None:
        _check_dp(dp_rank, dp_size, micro_batch_size)
        self.path = resolve_data_path(path, seq_len, cache_dir, "val")
        src = _Source(self.path, seq_len, cache_dir, validate_hash=validate_hash, hashes_verified=hashes_verified,
                      seq_len_field=EVAL_SEQ_LEN)
        self.manifest: dict = src.manifest
        self.num_samples = src.num_samples
        plan = list(range(src.num_samples)) if indices is None else [int(i) for i in indices]
        bad = [i for i in plan if not 0 <= i < src.num_samples]
        if bad:
            raise DataError(f"{self.path}: sample index {bad[0]} out of range (dataset has {src.num_samples})")
        n = len(plan)
        lo, hi = dp_rank * n // dp_size, (dp_rank + 1) * n // dp_size
        per_rank = -(-n // dp_size)
        self.num_batches = -(-per_rank // micro_batch_size)
        total = self.num_batches * micro_batch_size
        mine = plan[lo:hi]
        self._rows = list(range(lo, hi)) + [-1] * (total - len(mine))  # positions in the plan; -1 = padding
        self._indices = mine + [mine[0] if mine else 0] * (total - len(mine))
        self._real = [True] * len(mine) + [False] * (total - len(mine))
        self._ds, fd = src.open(shuffle=False, shuffle_seed=0, batch_size=micro_batch_size,
                                num_canonical_nodes=1, cfg=None)
        self._finalizer = weakref.finalize(self._ds, _release, fd, self._ds._shm_prefix_int,
                                           vars(self._ds))
        self._collate = _Collate(int(self.manifest["eos_id"]), mask_document_boundaries, with_source,
                                 vocab_size=self.manifest.get("vocab_size"), where=str(self.path))
        self._loader = DataLoader(_EvalItems(self._ds, self._indices, self._real),
                                  batch_size=micro_batch_size, shuffle=False,
                                  num_workers=num_workers, collate_fn=self._collate,
                                  pin_memory=torch.cuda.is_available())

    def __len__(self) -> int:
        return self.num_batches

    def rank_rows(self) -> list[list[int]]:
        """Per batch, each row's position in the evaluated plan (``indices``), -1 for padding rows."""
        b = len(self._rows) // max(self.num_batches, 1)
        return [self._rows[k * b:(k + 1) * b] for k in range(self.num_batches)]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return _batches(start_shielded(lambda: iter(self._loader)))

    def close(self) -> None:
        """Release the cache slot and streaming's file locks."""
        self._finalizer()


def build_train_loader(cfg: DataConfig, *, seq_len: int, micro_batch_size: int, dp_rank: int,
                       dp_size: int, seed: int, hashes_verified: bool = False) -> TrainLoader:
    """Infinite, shuffled, exactly-resumable loader for DP rank ``dp_rank`` of ``dp_size``.

    ``cfg.path == "default"`` builds/uses the embedded corpus (``default:val`` etc. pick a split).
    Shuffle seed = ``cfg.shuffle_seed + seed``. ``hashes_verified``: the caller checked the shard
    hashes already (:func:`megaloop.data.streaming.verify_dataset`), so the loader does not.
    """
    if not isinstance(cfg, DataConfig):
        raise ConfigError(f"data: expected a DataConfig, got {type(cfg).__name__}")
    return TrainLoader(cfg, seq_len=seq_len, micro_batch_size=micro_batch_size, dp_rank=dp_rank,
                       dp_size=dp_size, seed=seed, hashes_verified=hashes_verified)


def build_eval_loader(path: str | Path, *, seq_len: int, micro_batch_size: int, dp_rank: int,
                      dp_size: int, cache_dir: str | None = None, num_workers: int = 0,
                      mask_document_boundaries: bool = False,
                      with_source: bool = False, indices: Sequence[int] | None = None,
                      validate_hash: bool = True, hashes_verified: bool = False) -> EvalLoader:
    """Deterministic, unshuffled, finite loader; ``default`` = embedded validation set,
    ``default:screen`` = embedded LR-screen set. ``with_source`` adds ``batch["source"]``.
    ``indices``: evaluate these samples in this order (default: all, in file order); each DP rank
    takes a contiguous slice. ``validate_hash``/``hashes_verified``: as ``data.validate_hash`` and
    :func:`build_train_loader`'s."""
    return EvalLoader(str(path), seq_len=seq_len, micro_batch_size=micro_batch_size,
                      dp_rank=dp_rank, dp_size=dp_size, cache_dir=cache_dir,
                      num_workers=num_workers, mask_document_boundaries=mask_document_boundaries,
                      with_source=with_source, indices=indices, validate_hash=validate_hash,
                      hashes_verified=hashes_verified)


def read_sources(path: str | Path, *, seq_len: int, cache_dir: str | None = None, **checks: bool) -> list[str]:
    """The ``source`` column of every sample of an eval set, in file order ("" where absent);
    ``checks``: ``validate_hash``/``hashes_verified`` as :func:`build_eval_loader`'s."""
    loader = EvalLoader(str(path), seq_len=seq_len, micro_batch_size=1, dp_rank=0, dp_size=1,
                        cache_dir=cache_dir, **checks)
    try:
        return [str(loader._ds[i].get("source", "") or "") for i in range(loader.num_samples)]
    finally:
        loader.close()


def source_balanced_order(sources: Sequence[str]) -> list[int]:
    """Sample indices interleaving sources round-robin (sources sorted by name, each in file order):
    any prefix of the result is as balanced across sources as its length allows (MixVal)."""
    by: dict[str, list[int]] = {}
    for i, name in enumerate(sources):
        by.setdefault(name, []).append(i)
    queues = [by[k] for k in sorted(by)]
    out: list[int] = []
    for k in range(max((len(q) for q in queues), default=0)):
        out.extend(q[k] for q in queues if k < len(q))
    return out
