"""Config of the training/validation data streams."""

from __future__ import annotations

from dataclasses import dataclass

from megaloop.config_utils import require


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

    def __post_init__(self) -> None:
        require(bool(self.path), "data.path", "must not be empty")
        require(self.num_workers >= 0, "data.num_workers", f"must be >= 0, got {self.num_workers}")
