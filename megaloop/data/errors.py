"""Errors raised by the data pipeline."""

from __future__ import annotations

from megaloop.errors import UserError


class DataError(UserError, ValueError):
    """Input or output data is missing, malformed or corrupt; the message names the file."""


class NothingPackedError(DataError):
    """The converter could not pack one sequence of ``seq_len`` tokens; ``counts`` says why
    (documents, tokens, held-out and empty documents, zero-weight sources), for callers that
    word the error for their own option (``megaloop eval --seq-len``)."""

    def __init__(self, message: str, *, seq_len: int, counts: str):
        super().__init__(message)
        self.seq_len, self.counts = seq_len, counts
