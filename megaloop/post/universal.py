"""Resume a ZeRO-1/2/3 DeepSpeed checkpoint on another process count through DeepSpeed's universal
checkpoint.

:func:`universal_checkpoint` converts ``ckpt/tag`` with DeepSpeed's own converter
(``deepspeed.checkpoint.ds_to_universal``) into ``ckpt/<tag>.universal/<tag>``: written whole in a
hidden staging folder beside it, then renamed into place (the original checkpoint is untouched; an
existing conversion, complete by construction, is reused while the checkpoint's files are the ones it
was made from, recorded in its ``source.json``; otherwise it is made again). The engine then loads it with
``checkpoint.load_universal`` set, which restores the fp32 parameters and the Adam moments at the new
data-parallel size; the client state comes back from the copied ``mp_rank_00_model_states.pt`` (ZeRO-3:
``zero_pp_rank_0_mp_rank_00_model_states.pt``). ZeRO-3 needs DeepSpeed ≥ 0.17 (its stage-3 universal
load); the pinned 0.19.8 has it."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

SUFFIX = ".universal"


def universal_root(ckpt: Path, tag: str) -> Path:
    """The folder ``load_checkpoint`` is given for the conversion of ``ckpt/tag`` (it holds ``tag``)."""
    return Path(ckpt) / f"{tag}{SUFFIX}"


STAMP = "source.json"  # in the conversion's root: the files of the checkpoint it was made from


def source_signature(src: Path) -> list[list]:
    """``[relative path, size, mtime_ns, inode, ctime_ns]`` of every file of the checkpoint folder ``src``, sorted. A
    conversion is reused only while it equals the one recorded in it: a tag saved again (a run
    restarted with ``--overwrite`` into the same folder writes ``step000010`` anew) resumed from the
    earlier run's conversion, silently (the other run's weights and Adam state, exit 0)."""
    out = []
    for p in src.rglob("*"):
        if p.is_file():
            st = p.stat()  # size and mtime repeat when a save of the same shapes lands in one mtime tick
            out.append([str(p.relative_to(src)), st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns])
    return sorted(out)


def _current(root: Path, src: Path, tag: str) -> bool:
    try:
        return (root / tag).is_dir() and json.loads((root / STAMP).read_text()) == source_signature(src)
    except (OSError, ValueError):  # no stamp (a conversion of an earlier release) or unreadable: rebuild
        return False


def _convert(src: Path, root: Path, tag: str) -> None:
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    staging = root.parent / f".{root.name}.tmp{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    args = SimpleNamespace(input_folder=str(src), output_folder=str(staging / tag), num_extract_workers=1,
                           num_merge_workers=1, keep_temp_folder=False, strict=True,
                           inject_missing_state=True)  # a plain module stores no universal-checkpoint info
    sink = io.StringIO()
    try:
        signature = source_signature(src)
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):  # the converter's progress chatter
            ds_to_universal(args)
        (staging / STAMP).write_text(json.dumps(signature))
        if root.exists():  # a stale conversion (derived data): replaced whole
            shutil.rmtree(root)
        os.replace(staging, root)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def universal_checkpoint(ckpt: str | Path, tag: str, *, rank: int = 0, world: int = 1) -> Path:
    """The universal conversion of ``ckpt/tag`` (made by rank 0 if missing; every rank calls this)."""
    import torch

    root = universal_root(Path(ckpt), tag)
    err: BaseException | None = None
    if rank == 0 and not _current(root, Path(ckpt) / tag, tag):
        try:
            _convert(Path(ckpt) / tag, root, tag)
        except Exception as e:  # noqa: BLE001 - re-raised after the barrier, so no rank waits forever
            err = e
    if world > 1:
        from megaloop.runtime.parallel import comm_device

        flag = torch.tensor([1 if err is not None else 0], device=comm_device())
        torch.distributed.broadcast(flag, 0)
        if flag.item() and err is None:
            from megaloop.config_utils import ConfigError

            raise ConfigError(f"--resume: converting {Path(ckpt) / tag} to a universal checkpoint failed on rank 0")
    if err is not None:
        raise err
    return root
