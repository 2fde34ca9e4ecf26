"""Loader and scorer of the shipped ``megaloop_synth_k*`` lm-eval tasks (``!function`` targets).

``load_synth`` reads ``megaloop_synth.jsonl`` beside this file (or ``data_files``, relative to this
folder) offline with the ``json`` builder of ``datasets`` and keeps the problems of the task's
``metadata.k``. ``process_results`` turns a loglikelihood result into ``acc`` (the continuation is
the greedy one: exact match) and ``ce`` (−log p of the continuation, nats). Only ``datasets`` is
imported: plain ``lm_eval --include_path megaloop/eval/tasks`` needs no megaloop install.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent


def load_synth(data_files: dict | None = None, k: int | None = None, **_metadata) -> "datasets.DatasetDict":  # noqa: F821
    """Split ``test`` of the held-out programs, filtered to chain length ``k`` (all when None)."""
    import datasets

    files = {split: str(p if Path(p).is_absolute() else HERE / p)
             for split, p in (data_files or {"test": "megaloop_synth.jsonl"}).items()}
    for split, path in files.items():
        if not Path(path).is_file():
            raise FileNotFoundError(f"lm-eval task data for split {split!r} not found: {path}")
    ds = datasets.load_dataset("json", data_files=files)
    return ds if k is None else ds.filter(lambda doc: doc["k"] == int(k))


def process_results(doc: dict, results: list) -> dict:
    """``{"acc": 1 if greedy else 0, "ce": -loglikelihood}`` of one loglikelihood request."""
    ll, is_greedy = results[0]
    return {"acc": int(bool(is_greedy)), "ce": -float(ll)}
