"""The error of a conversion between megaloop and Hugging Face formats."""

from __future__ import annotations

from megaloop.errors import UserError


class ConversionError(UserError, RuntimeError):
    """The model cannot be mapped onto the HF model, or the mapped model does not reproduce it."""
