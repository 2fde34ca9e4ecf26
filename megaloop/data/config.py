"""Config of the training/validation data streams."""

from __future__ import annotations

import re
from dataclasses import dataclass

from megaloop.config_utils import require

EMBEDDED_SPLITS = ("train", "val", "screen")


# what mosaicml-streaming's cache_limit accepts: a byte count, or a number with a b/kb/mb/.../yb unit
_BYTES = re.compile(r"\d+b?|(\d+\.?\d*|\.\d+)\s*[kmgtpezy]b", re.IGNORECASE)


def embedded_split(path: str | None, default: str) -> str | None:
    """The embedded corpus's split that ``path`` names (``default`` -> ``default``, ``default:<split>``
    -> ``<split>``); None for any other path."""
    if path == "default":
        return default
    if isinstance(path, str) and path.startswith("default:"):
        return path.split(":", 1)[1]
    return None


@dataclass
class DataConfig:
    """Where the MDS shards are and how they are streamed.

    path: ``default`` builds (once, cached) and uses the embedded corpus; otherwise a local
    directory or remote URL (s3://, gs://, ...) of MDS shards written by data_prep/txt360_to_mds.py.
    """

    path: str = "default"
    val_path: str | None = None  # MDS shards of the validation set; None = none
    cache_dir: str | None = None  # local cache for remote shards / the embedded default
    shuffle: bool = True
    shuffle_seed: int = 1234
    num_workers: int = 0
    mask_document_boundaries: bool = False  # zero loss on the token after each EOS
    prefetch_factor: int = 2  # batches prefetched per DataLoader worker (num_workers > 0)
    # streaming knobs. num_canonical_nodes: None = dp_size; keep it fixed (e.g. a multiple of every
    # DP size you may resume at) to resume one sample order at another DP size.
    num_canonical_nodes: int | None = None
    shuffle_algo: str = "py1e"
    shuffle_block_size: int | None = None  # None = streaming's default
    cache_limit: str | None = None  # e.g. "50gb": bound on each process' shard cache slot
    predownload: int | None = None  # samples downloaded ahead; None = 8 x micro-batch size
    # xxh64 of shards against index.json: local shards once per file (size, mtime) before a run, copies as
    # they are cached (megaloop.data.integrity)
    validate_hash: bool = True

    def __post_init__(self) -> None:
        require(bool(self.path), "data.path", "must not be empty")
        train, val = embedded_split(self.path, "train"), embedded_split(self.val_path, "val")
        for field, split in (("data.path", train), ("data.val_path", val)):
            require(split is None or split in EMBEDDED_SPLITS, field,
                    f"unknown embedded split {split!r} (default:train, default:val, default:screen)")
        require(val is None or val != train, "data.val_path",
                f"{self.val_path} is the embedded corpus's {val} split, which data.path={self.path} trains on: "
                "validation would score the training data (the embedded corpus holds default:val out of default:train)")
        require(self.num_workers >= 0, "data.num_workers", f"must be >= 0, got {self.num_workers}")
        require(self.prefetch_factor >= 1, "data.prefetch_factor",
                f"must be >= 1, got {self.prefetch_factor}")
        require(self.shuffle_seed >= 0, "data.shuffle_seed", f"must be >= 0, got {self.shuffle_seed}")
        require(self.num_canonical_nodes is None or self.num_canonical_nodes >= 1,
                "data.num_canonical_nodes", f"must be >= 1 or null, got {self.num_canonical_nodes}")
        require(self.shuffle_algo in ("py1e", "py1b", "py1br", "py1s", "py2s", "naive"),
                "data.shuffle_algo", f"unknown algorithm {self.shuffle_algo!r}")
        require(self.predownload is None or self.predownload >= 1, "data.predownload",
                f"must be >= 1 or null (8 x micro-batch size), got {self.predownload}")  # -5 hung in set-up
        require(self.cache_limit is None or _BYTES.fullmatch(str(self.cache_limit).strip()) is not None,
                "data.cache_limit", f"expected a size such as 50gb, 512mb or a byte count, got {self.cache_limit!r}")
        require(self.shuffle_block_size is None or self.shuffle_block_size >= 1,
                "data.shuffle_block_size", f"must be >= 1 or null, got {self.shuffle_block_size}")
