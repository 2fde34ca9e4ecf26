"""argparse ``type`` functions shared by the verbs' command lines (a bad value is argparse's one
line and exit 2, before a model loads)."""

from __future__ import annotations

import argparse

SEED_BOUND = 2**64  # torch.Generator.manual_seed takes [-2**63, 2**64); train.seed takes [0, 2**64)


def seed_int(text: str) -> int:
    """A seed in ``[0, 2**64)``, as ``train.seed`` (a larger one overflowed inside torch, after loading)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if not 0 <= value < SEED_BOUND:
        raise argparse.ArgumentTypeError(f"must be in [0, 2**64), got {value}")
    return value


def nonempty_text(text: str) -> str:
    """An option value that may not be empty (``--exit "$EXIT"`` with the variable unset)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty value (an unset shell variable?)")
    return text
