"""The records RL tasks are made of: :class:`Example` and the JSONL reader that names the file and
line of a bad record (shared by :mod:`megaloop.post.rl.tasks` and :mod:`megaloop.post.rl.sandbox`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence


@dataclass
class Example:
    prompt: str
    answer: str
    meta: dict = field(default_factory=dict)


def read_jsonl(path: str | Path, required: Sequence[str] = ()) -> list[tuple[int, dict]]:
    """``(line number, record)`` of a JSONL file; a malformed record raises ``ValueError`` naming
    the file and line."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ValueError(f"{path}: cannot read ({err.strerror or err})") from None
    try:
        # JSONL lines end at "\n" only: splitlines() also split inside strings at U+2028, U+0085, ...
        lines = data.decode("utf-8").split("\n")
    except UnicodeDecodeError as err:
        line = data[:err.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start})") from None
    out = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{lineno}: not a JSON record ({err.msg})") from None
        if not isinstance(rec, dict):
            raise ValueError(f"{path}:{lineno}: a record must be a JSON object")
        missing = [k for k in required if k not in rec]
        if missing:
            raise ValueError(f"{path}:{lineno}: missing key(s) {', '.join(map(repr, missing))}")
        out.append((lineno, rec))
    return out
