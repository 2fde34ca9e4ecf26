"""Dataset loaders of the shipped lm-eval tasks (referenced from their YAMLs via ``!function``).

lm-eval resolves ``dataset_kwargs.data_files`` against the *working directory*; these loaders
resolve the task's JSONL against this folder instead, so ``lm_eval --include_path
megaloop/eval/tasks --tasks megaloop_toy_mc`` works from any directory, offline (the ``json``
builder of ``datasets``; no hub access). Only ``datasets`` is imported: plain lm-eval needs no
megaloop install. lm-eval calls a ``custom_dataset`` with the task's ``metadata`` and
``dataset_kwargs`` as keyword arguments.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent


def _json_splits(data_files: dict) -> "datasets.DatasetDict":  # noqa: F821 - lazy import
    import datasets

    files = {split: str(p if Path(p).is_absolute() else HERE / p) for split, p in data_files.items()}
    for split, path in files.items():
        if not Path(path).is_file():
            raise FileNotFoundError(f"lm-eval task data for split {split!r} not found: {path}")
    return datasets.load_dataset("json", data_files=files)


def load_toy_mc(data_files: dict | None = None, **_metadata) -> "datasets.DatasetDict":  # noqa: F821
    """``megaloop_toy_mc``: 24 multiple-choice questions (``question``, ``choices``, ``answer``),
    split ``test`` from ``megaloop_toy_mc.jsonl`` beside this file (or ``data_files``, relative
    to this folder)."""
    return _json_splits(data_files or {"test": "megaloop_toy_mc.jsonl"})
