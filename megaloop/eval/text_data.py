"""Text evaluation sets for ``megaloop eval ppl|sweep --data FILE`` (e.g. WikiText-103 as users
have it locally: ``wiki.test.raw``, or its JSONL / parquet exports).

Formats (by suffix):

* ``.txt`` / ``.raw`` / ``.text`` — the whole file is one document (UTF-8);
* ``.jsonl`` / ``.jsonl.gz`` — one JSON object per line, the document in ``--text-field``
  (default ``text``); blank lines are skipped;
* ``.parquet`` — the ``--text-field`` column, one document per row.

Documents are tokenised with the checkpoint's tokenizer, each followed by EOS, concatenated in
file order and cut into consecutive sequences of ``seq_len`` tokens (the tail shorter than one
sequence is dropped). Labels and loss mask follow the MDS loader: ``labels[:, i] = tokens[:, i+1]``,
the last position of every sequence has no target. A file that yields fewer tokens than one
sequence is a :class:`~megaloop.data.errors.DataError` naming the file and ``--seq-len``.
:class:`EvalData` (any evaluation set in memory) lives here; :mod:`megaloop.eval.ppl` imports it.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import torch

from megaloop.data.errors import DataError

PLAIN_SUFFIXES = (".txt", ".raw", ".text")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
PARQUET_SUFFIXES = (".parquet",)


@dataclass
class EvalData:
    """Evaluation sequences held in memory: ``tokens``/``labels`` [n, L] int64, ``loss_mask`` [n, L];
    ``sources`` the per-row ``source`` column of the set (None when it has none)."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    source: str = ""
    sources: Optional[list[str]] = None
    inputs: Optional[torch.Tensor] = None  # real input positions [n, L] (eval.states.input_positions); None: not set

    @property
    def num_seqs(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.tokens.shape[1])

    def batches(self, batch_size: int) -> Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        for i in range(0, self.num_seqs, batch_size):
            yield self.tokens[i:i + batch_size], self.labels[i:i + batch_size], self.loss_mask[i:i + batch_size]


def text_format(path: str | Path) -> Optional[str]:
    """``plain`` / ``jsonl`` / ``parquet`` for a supported text file name, else None."""
    name = str(path).lower()
    for fmt, suffixes in (("plain", PLAIN_SUFFIXES), ("jsonl", JSONL_SUFFIXES), ("parquet", PARQUET_SUFFIXES)):
        if name.endswith(suffixes):
            return fmt
    return None


def read_documents(path: str | Path, text_field: str = "text") -> list[str]:
    """The documents of a text file (see the module docstring); DataError naming the file (and
    line / column) on unreadable or malformed input."""
    path = Path(path)
    fmt = text_format(path)
    if fmt is None:
        known = ", ".join(PLAIN_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES)
        raise DataError(f"--data: {path}: unknown text format (use {known})")
    if not path.is_file():
        raise DataError(f"--data: {path} does not exist")
    try:
        if fmt == "plain":
            return [path.read_text(encoding="utf-8")]
        if fmt == "jsonl":
            return _jsonl_documents(path, text_field)
        return _parquet_documents(path, text_field)
    except UnicodeDecodeError as err:
        raise DataError(f"--data: {path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except (OSError, EOFError) as err:
        raise DataError(f"--data: {path}: cannot read: {err}") from None


def _jsonl_documents(path: Path, field: str) -> list[str]:
    docs = []
    opener = gzip.open if str(path).lower().endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"--data: {path}:{n}: invalid JSON ({err.msg})") from None
            if not isinstance(rec, dict) or not isinstance(rec.get(field), str):
                raise DataError(f"--text-field: {path}:{n} has no string field {field!r}")
            try:
                rec[field].encode("utf-8")  # a JSON escape can make a lone surrogate, which no tokenizer takes
            except UnicodeEncodeError as err:
                raise DataError(f"--data: {path}:{n}: {field!r} is not valid Unicode ({err.reason} at character "
                                f"{err.start})") from None
            docs.append(rec[field])
    return docs


def _parquet_documents(path: Path, field: str) -> list[str]:
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except Exception as err:  # pyarrow raises ArrowInvalid etc. for non-parquet files
        raise DataError(f"--data: {path}: not a parquet file ({err})") from None
    if field not in schema.names:
        raise DataError(f"--text-field: {path} has no column {field!r} (columns: {schema.names})")
    column = pq.read_table(path, columns=[field]).column(field).to_pylist()
    bad = next((i for i, v in enumerate(column) if v is not None and not isinstance(v, str)), None)
    if bad is not None:
        raise DataError(f"--text-field: {path}: column {field!r} is not text (row {bad})")
    return [v for v in column if v]


def pack_documents(docs: Sequence[Sequence[int]], eos_id: int, seq_len: int) -> torch.Tensor:
    """EOS-terminated documents concatenated and cut into ``[n, seq_len]`` int64 rows (the tail
    shorter than ``seq_len`` is dropped; ``n`` may be 0)."""
    stream: list[int] = []
    for ids in docs:
        stream.extend(int(t) for t in ids)
        stream.append(int(eos_id))
    n = len(stream) // seq_len
    return torch.tensor(stream[:n * seq_len], dtype=torch.long).reshape(n, seq_len)


def shifted_targets(tokens: torch.Tensor, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(labels, loss_mask)`` of ``tokens`` [n, L] as the MDS loader makes them: next-token
    labels, no target at the last position."""
    labels = torch.full_like(tokens, int(eos_id))
    labels[:, :-1] = tokens[:, 1:]
    mask = torch.ones(tokens.shape, dtype=torch.float32)
    mask[:, -1] = 0.0
    return labels, mask


def load_text_data(path: str | Path, *, encode: Callable[[str], list[int]], eos_id: Optional[int], seq_len: int,
                   max_seqs: Optional[int] = None, text_field: str = "text") -> EvalData:
    """:class:`EvalData` of ``seq_len``-token sequences from a text file,
    tokenised by ``encode`` (the checkpoint's tokenizer); at most ``max_seqs`` sequences."""
    if eos_id is None:
        raise DataError(f"--data: {path}: the checkpoint's tokenizer has no EOS token to separate documents")
    docs = read_documents(path, text_field)
    if not any(d.strip() for d in docs):
        what = "is empty" if not docs or not any(docs) else "holds only whitespace"
        rows = "" if text_format(path) == "plain" else f" ({len(docs)} documents in --text-field {text_field!r})"
        raise DataError(f"--data: {path} {what}{rows}: nothing to evaluate")
    ids = [encode(d) for d in docs]
    tokens = pack_documents(ids, eos_id, seq_len)
    total = sum(len(i) + 1 for i in ids)
    if tokens.shape[0] == 0:
        raise DataError(f"--data: {path} tokenises to {total} tokens ({len(docs)} documents), fewer than one "
                        f"sequence of --seq-len {seq_len}")
    if max_seqs is not None:
        tokens = tokens[:max_seqs]
    labels, mask = shifted_targets(tokens, eos_id)
    return EvalData(tokens, labels, mask, str(path))


__all__ = ["EvalData", "load_text_data", "pack_documents", "read_documents", "shifted_targets", "text_format"]
