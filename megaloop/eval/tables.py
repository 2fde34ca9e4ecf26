"""What the ``megaloop eval`` commands print and record besides their numbers: rich tables, number
formatting, adaptive-depth summaries and the sequence lengths a result was measured at."""

from __future__ import annotations

import math
from typing import Any


def lengths(engine, seq_len: int) -> dict:
    """The sequence length a result was measured at, beside the training one (RoPE positions past it are
    extrapolated): what every eval JSON records of its protocol."""
    trained = int(engine.config.max_position_embeddings)
    return {"seq_len": seq_len, "training_seq_len": trained, "rope_extrapolated": seq_len > trained}


def fmt(x: Any, digits: int = 4) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        if math.isnan(x) or math.isinf(x):
            return str(x)
        return f"{x:.{digits}g}" if abs(x) < 1e-3 or abs(x) >= 1e5 else f"{x:.{digits}f}".rstrip("0").rstrip(".")
    return str(x)


def depth_summary(stats: dict) -> str:
    """One line of a protocol's adaptive depths (``PPLResult.adaptive_depths[mode]``): scored tokens only."""
    if not stats.get("tokens"):
        return "no scored tokens"
    hist = " ".join(f"{d}:{c}" for d, c in stats["histogram"].items())
    return f"mean depth {stats['mean_depth']:.2f} over {stats['tokens']} scored tokens; depth:tokens {hist}"


def table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    for c in columns:
        t.add_column(c)
    for r in rows:
        t.add_row(*[fmt(x) for x in r])
    Console().print(t)
