"""Errors raised by the data pipeline."""

from __future__ import annotations

from megaloop.errors import UserError


class DataError(UserError, ValueError):
    """Input or output data is missing, malformed or corrupt; the message names the file."""
