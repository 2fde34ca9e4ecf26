"""Where a sweep command (``lr-screen``, ``reproduce``) may write: ``--out`` checks shared by both
(a folder that can be created, not another command's results or a run / model, not inside a dataset
the runs read)."""

from __future__ import annotations

import json
from pathlib import Path

from megaloop.errors import UserError
from megaloop.post.runs import SWEEP_MARKERS, folder_holds


def check_out_dir(out: str | None, *, probe: bool = True) -> None:
    """``--out`` is a directory or can become one: its nearest existing part is a directory (not a
    dangling link) in which a file can be created (``probe``; off for ``--dry-run``, which writes nothing)."""
    if not out:
        return
    from megaloop.runtime.files import cannot_create_in, dangling_link, nearest_existing

    p = nearest_existing(out)
    if link := dangling_link(p):
        raise UserError(f"--out: {out}: {link}")
    if not p.is_dir():
        raise UserError(f"--out: {out} exists and is not a directory" if p == Path(out) else
                        f"--out: {out}: {p} is not a directory")
    why = cannot_create_in(p) if probe else None
    if why is not None:
        raise UserError(f"--out: {out}: no file can be created in {p} ({why}); give a folder you can write to")


# what marks a folder as written by each sweep command (a results.json alone: by its keys)
_MARKERS = {kind: marker for kind, marker, _ in SWEEP_MARKERS}


def folder_kind(out: Path) -> str | None:
    """Which command's outputs ``out`` holds: ``lr-screen``, ``reproduce`` (also a merged result,
    which has no plan.json), ``unknown`` (a results.json of neither) or None (none of them)."""
    for kind, marker in _MARKERS.items():
        if (out / marker).is_file():
            return kind
    res = out / "results.json"
    if not res.is_file():
        return None
    try:
        data = json.loads(res.read_text())
    except (OSError, ValueError):
        return "unknown"
    if isinstance(data, dict) and "experiment" in data and "arms" in data:
        return "reproduce"
    if isinstance(data, dict) and "grid" in data and "points" in data:
        return "lr-screen"
    return "unknown"


def check_out_kind(out: str | Path | None, kind: str, flag: str = "--out") -> None:
    """Refuse an ``out`` holding another command's results (both write ``results.json``), or the folder of a
    run or model (a pretraining run, an RL run, a prefill student, an HF model)."""
    if not out:
        return
    run = folder_holds(Path(out))
    if run is not None and run[0] in ("pretraining", "rl", "student", "hf"):
        raise UserError(f"{flag}: {out} holds {run[1]}, not `megaloop {kind}` results: writing there would mix "
                        "the two; choose another folder")
    held = folder_kind(Path(out))
    if held is not None and held != kind:
        what = f"a `megaloop {held}` result" if held != "unknown" else "a results.json of another tool"
        raise UserError(f"{flag}: {out} holds {what}, which `megaloop {kind}` would overwrite; choose another folder")


def check_out_outside_data(out: str | Path, data_paths: dict[str, str | None], flag: str = "--out") -> None:
    """Refuse an ``out`` that is a dataset or lies inside one of ``data_paths`` (field -> path); the
    ``RunDirError`` is a ``UserError``: one line, exit 2, from the sweep's ``run_cli``."""
    from megaloop.train.run_dir import check_run_dir_location

    check_run_dir_location(Path(out), data_paths, flag=flag, writes="the runs and reports are written there")


__all__ = ["check_out_dir", "check_out_kind", "check_out_outside_data", "folder_kind"]
