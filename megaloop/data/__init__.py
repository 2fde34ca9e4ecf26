"""Data pipeline: TxT360 -> MDS conversion, eval sets, the embedded default corpus, loaders.

Importing this package is cheap and makes ``import streaming`` work beside CPU torch (see
``_streaming_compat``); the loaders (torch, streaming) load on first use. Public API::

    build_train_loader(cfg, *, seq_len, micro_batch_size, dp_rank, dp_size, seed) -> TrainLoader
    build_eval_loader(path, *, seq_len, micro_batch_size, dp_rank, dp_size, ...) -> EvalLoader
    ensure_default_dataset(cache_dir=None, seq_len=256, ...) -> Path   # train/ val/ screen/ tokenizer/
    load_tokenizer(path) -> Tokenizer   # encode, decode, vocab_size, eos_id
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from megaloop.data._streaming_compat import install_import_hook
from megaloop.data.config import DataConfig
from megaloop.data.errors import DataError

install_import_hook()

_LAZY = {
    "build_train_loader": "megaloop.data.loaders", "build_eval_loader": "megaloop.data.loaders",
    "TrainLoader": "megaloop.data.loaders", "EvalLoader": "megaloop.data.loaders",
    "ensure_default_dataset": "megaloop.data.default_corpus",
    "ensure_default_tokenizer": "megaloop.data.default_corpus",
    "load_tokenizer": "megaloop.data.tokenizer", "Tokenizer": "megaloop.data.tokenizer",
    "load_manifest": "megaloop.data.streaming", "make_batch": "megaloop.data.streaming",
}

if TYPE_CHECKING:
    from megaloop.data.default_corpus import ensure_default_dataset, ensure_default_tokenizer
    from megaloop.data.loaders import EvalLoader, TrainLoader, build_eval_loader, build_train_loader
    from megaloop.data.streaming import load_manifest, make_batch
    from megaloop.data.tokenizer import Tokenizer, load_tokenizer


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'megaloop.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = [
    "DataConfig", "DataError", "EvalLoader", "TrainLoader", "Tokenizer", "build_eval_loader",
    "build_train_loader", "ensure_default_dataset", "ensure_default_tokenizer", "load_manifest",
    "load_tokenizer", "make_batch",
]
