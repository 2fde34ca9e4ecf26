"""Data pipeline: TxT360 -> MDS conversion, eval sets, the embedded default corpus, loaders.

Importing this package makes ``import streaming`` work beside CPU torch (see
``_streaming_compat``). Public API::

    build_train_loader(cfg, *, seq_len, micro_batch_size, dp_rank, dp_size, seed) -> TrainLoader
    build_eval_loader(path, *, seq_len, micro_batch_size, dp_rank, dp_size, ...) -> EvalLoader
    ensure_default_dataset(cache_dir=None, seq_len=256, ...) -> Path   # train/ val/ screen/ tokenizer/
    load_tokenizer(path) -> Tokenizer   # encode, decode, vocab_size, eos_id
"""

from megaloop.data._streaming_compat import ensure_streaming_importable

ensure_streaming_importable()

from megaloop.data.config import DataConfig  # noqa: E402
from megaloop.data.default_corpus import ensure_default_dataset, ensure_default_tokenizer  # noqa: E402
from megaloop.data.errors import DataError  # noqa: E402
from megaloop.data.loaders import (EvalLoader, TrainLoader, build_eval_loader,  # noqa: E402
                                   build_train_loader)
from megaloop.data.streaming import load_manifest, make_batch  # noqa: E402
from megaloop.data.tokenizer import Tokenizer, load_tokenizer  # noqa: E402

__all__ = [
    "DataConfig", "DataError", "EvalLoader", "TrainLoader", "Tokenizer", "build_eval_loader",
    "build_train_loader", "ensure_default_dataset", "ensure_default_tokenizer", "load_manifest",
    "load_tokenizer", "make_batch",
]
