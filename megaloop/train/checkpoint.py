"""Distributed checkpoints (megatron ``dist_checkpointing``, torch_dist format), published atomically.

Layout: ``RUN/checkpoints/step_00000042/`` holds megatron's files (``common.pt``, ``*.distcp``,
``.metadata``, ``metadata.json``) plus ``megaloop.json`` (step, config) written last;
``RUN/checkpoints/latest`` names the newest complete one (informative: resolution takes the newest
complete ``step_*``, as a kill between the rename and the pointer write leaves the pointer behind).
A checkpoint is written into a hidden temporary directory and renamed into place only after every
rank finished, so an interrupted save never looks complete and never replaces the last good
checkpoint; a save the filesystem refuses removes that directory and fails in one line
(:class:`CheckpointSaveError`). megatron's writer runs without a helper process
(:func:`megaloop.train.ckpt_io.in_process_write_queue`), so a signal to the whole process group
cannot break the stop checkpoint. A directory holding only incomplete ``step_*`` checkpoints is
refused rather than trained over from step 0 (:func:`refuse_incomplete`).

Keys do not depend on the parallel layout (layers are named ``prelude.i``/``core.i``/``coda.i``;
TP shards carry global shapes; core replicas on later pipeline stages are marked as replicas),
so a checkpoint written at one TP/PP layout loads at another. The distributed optimizer state
uses megatron's ``fully_reshardable`` format for the same reason.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedBase

from megaloop.errors import UserError
from megaloop.model.build import unwrap
from megaloop.runtime.files import atomic_write_text, describe_os_error
from megaloop.train.ckpt_io import agree, explain_save_failure, in_process_write_queue
from megaloop.train.ckpt_repeats import fill_repeats, set_repeats_aside
from megaloop.train.optim_layout import buffer_layout_world_tensors

META = "megaloop.json"
SHARDING_META = {"distrib_optim_sharding_type": "fully_reshardable"}
REPLICA_PREFIXES = ("core.", "injection.")


class CheckpointError(UserError, RuntimeError):
    """A checkpoint is missing, incomplete or unreadable; the message names the path."""


class CheckpointSaveError(CheckpointError):
    """A checkpoint could not be written (disk full, no permission): the message names the
    directory and the OS error; nothing of the failed save is left behind."""


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, text: str) -> None:
    """:func:`megaloop.runtime.files.atomic_write_text`, then the directory entry made durable."""
    atomic_write_text(path, text)
    _fsync_dir(path.parent)


def _mark_core_replicas(sd: dict, stage: int) -> None:
    """Core/injection tensors exist on every virtual stage; only stage 0's copy is the main one."""
    if stage == 0:
        return
    for t in nested_values(sd):
        if isinstance(t, ShardedBase) and t.key.startswith(REPLICA_PREFIXES):
            rid = t.replica_id
            t.replica_id = (stage, *rid[1:]) if isinstance(rid, tuple) else (stage, rid)


def sharded_state(model_chunks: list, optimizer=None, *, is_loading: bool) -> dict:
    """The sharded state dict of the model chunks (``model{i}``) and the optimizer."""
    sd: dict[str, Any] = {}
    for i, chunk in enumerate(model_chunks):
        core = unwrap(chunk)  # keys without DDP/Float16Module prefixes
        msd = core.sharded_state_dict(prefix="", metadata=dict(SHARDING_META))
        _mark_core_replicas(msd, core.stage)
        sd[f"model{i}"] = msd
    if optimizer is not None:  # with megatron 0.16.1's shifted-save bug fixed (optim_layout.py)
        with buffer_layout_world_tensors(optimizer):
            sd["optimizer"] = optimizer.sharded_state_dict(sd, is_loading=is_loading,
                                                           metadata=dict(SHARDING_META))
    return sd


def _is_torch_adam(opt) -> bool:
    """The workarounds below target torch's Adam/AdamW (megatron's fallback without apex/TE);
    TE's and apex's FusedAdam keep ``step`` in the param groups and are left alone."""
    return isinstance(opt, (torch.optim.Adam, torch.optim.AdamW))


def _torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    chain = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [o.optimizer for o in chain if _is_torch_adam(getattr(o, "optimizer", None))]


def _ensure_adam_state(optimizer) -> None:
    """Give a fresh optimizer zero Adam state without stepping it. megatron-core 0.16.1's
    distributed optimizer asserts one shared ``step`` value when building the state dict it
    loads into or saves, which a never-stepped torch Adam does not have (and its own dummy step
    would apply weight decay to the parameters). Step 0 and zero moments are what torch's Adam
    creates at its first step, so the next update is the same as from a fresh optimizer."""
    for opt in _torch_optimizers(optimizer):
        for group in opt.param_groups:
            for p in group["params"]:
                if p not in opt.state or not opt.state[p]:
                    opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                    "exp_avg_sq": torch.zeros_like(p)}


def _refuse_unstepped_fused(optimizer, step: int) -> None:
    """A distributed optimizer over an optimizer other than torch's Adam (Transformer Engine's or apex's
    FusedAdam, the GPU default) that has never stepped holds no state megatron could save (it fails on
    the missing moments); :func:`_ensure_adam_state` fills torch's only. Refused in one line, before
    anything is written (collective: every rank decides the same)."""
    for o in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(o, "optimizer", None)
        if type(o).__name__ != "DistributedOptimizer" or inner is None or _is_torch_adam(inner):
            continue
        if not any(inner.state.get(p) for g in inner.param_groups for p in g["params"]):
            raise CheckpointSaveError(
                f"checkpoint step {step}: no update has been applied yet (every step so far was non-finite) and "
                f"{type(inner).__name__} creates its state at its first update, so the distributed optimizer has "
                "nothing to save; nothing was written (the initial weights follow from train.seed): fix the "
                "cause of the non-finite loss and start the run again")


def _unshare_adam_steps(optimizer) -> None:
    """megatron-core 0.16.1 loads one ``step`` tensor into every parameter's state; torch Adam
    increments it in place once per parameter, so give each parameter its own copy."""
    for opt in _torch_optimizers(optimizer):
        for state in opt.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


@contextmanager
def _keep_adam_step_on_load(optimizer):
    """megatron-core 0.16.1's distributed optimizer copies every key of a parameter's torch-Adam
    state from the checkpoint, including ``step``, which its checkpoint tensors do not carry
    (KeyError: 'step'). ``step`` is restored from the param groups instead, so during the load
    each parameter keeps its own ``step`` entry."""
    chain = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    patched = []
    for opt in chain:
        orig = getattr(opt, "_set_main_param_and_optimizer_states", None)
        if (orig is None or not _is_torch_adam(getattr(opt, "optimizer", None))
                or opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8):
            continue

        def fixed(model_param, tensors, _orig=orig, _opt=opt):
            if "step" not in tensors:
                gi, go = _opt.model_param_group_index_map[model_param]
                state = _opt.optimizer.state[_opt.optimizer.param_groups[gi]["params"][go]]
                if "step" in state:
                    tensors = {**tensors, "step": state["step"]}
            return _orig(model_param, tensors)

        opt._set_main_param_and_optimizer_states = fixed
        patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states


def load_model_state(module: torch.nn.Module, state: dict, *, strict: bool, where: str) -> None:
    """``load_state_dict`` that tolerates missing ``*._extra_state`` entries: Transformer Engine
    modules without sharded state (e.g. TE's core attention) still report ``_extra_state`` in
    ``state_dict()``, but megatron never saves it (as Megatron-LM's own loader tolerates). Any other
    missing or unexpected key fails under ``strict``, naming the checkpoint."""
    res = module.load_state_dict(state, strict=False)
    missing = [k for k in res.missing_keys if not k.endswith("_extra_state")]
    if strict and (missing or res.unexpected_keys):
        raise CheckpointError(f"checkpoint {where} does not match the model: missing {missing[:8]}, "
                              f"unexpected {list(res.unexpected_keys)[:8]}")


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def step_of(path: Path) -> int:
    """The step of a ``step_00000042`` directory (-1 for another name)."""
    head, _, num = path.name.partition("_")
    return int(num) if head == "step" and num.isdigit() else -1


def is_complete(path: Path) -> bool:
    return (path / META).is_file() and (path / ".metadata").is_file() and (path / "common.pt").is_file()


def check_meta(path: Path) -> Path:
    """``path`` when its ``megaloop.json`` (written last by a save) parses as a JSON object, else
    ``CheckpointError`` naming the file: a truncated or overwritten marker means the checkpoint was
    not written by a finished save (or was damaged since)."""
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint {path}: {META} is unreadable ({type(err).__name__}); "
                              "the checkpoint was not written by a finished save") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint {path}: {META} holds a JSON {type(meta).__name__}, not the save's "
                              "record; the checkpoint was not written by a finished save")
    return path


def find_checkpoint(path: str | Path) -> Path:
    """A complete checkpoint directory: ``path`` itself (``step_*``), or the newest complete one
    under ``path`` (a ``checkpoints`` dir) or ``path/checkpoints`` (a run dir). ``CheckpointError``
    naming the path otherwise."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint {p} does not exist")
    if not p.is_dir():
        raise CheckpointError(f"checkpoint {p} is not a directory")
    markers = [n for n in (META, ".metadata", "common.pt") if (p / n).is_file()]
    if markers:
        if not is_complete(p):
            missing = [n for n in (META, ".metadata", "common.pt") if not (p / n).is_file()]
            raise CheckpointError(f"checkpoint {p} is incomplete: missing {', '.join(missing)} "
                                  "(interrupted while being written?)")
        return check_meta(p)
    incomplete: list[Path] = []
    for root in (p, p / "checkpoints"):
        if root.is_dir():
            manager = CheckpointManager(root)
            latest = manager.latest()
            if latest is not None:
                return check_meta(latest)
            incomplete += manager.incomplete_checkpoints()
    if incomplete:  # e.g. a save killed part-way, or a partial copy
        newest = incomplete[-1]
        missing = [n for n in (META, ".metadata", "common.pt") if not (newest / n).is_file()]
        raise CheckpointError(f"{p} holds no complete checkpoint: {newest} is incomplete (missing "
                              f"{', '.join(missing)}: a partial copy, or files deleted?)"
                              + (f", as are {len(incomplete) - 1} older ones" if len(incomplete) > 1 else ""))
    hint = ""
    if (p / "config.json").is_file() and any(p.glob("*.safetensors")):
        hint = ("; it is a Hugging Face folder: `megaloop convert --from-hf --checkpoint "
                f"{p} --out DIR` turns it back into one")
    raise CheckpointError(
        f"{p} is not a megaloop checkpoint: expected a checkpoint directory holding {META}, "
        f".metadata and common.pt (RUN/checkpoints/step_*), or a run / checkpoints directory with one{hint}")


MODEL_PREFIXES = ("embedding.", "prelude.", "core.", "coda.", "layers.", "injection.", "state_readout.",
                  "final_norm.", "output_layer.")


def verify_model_tensors(path: Path, model_chunks: list) -> dict:
    """Compare the stored model tensors (names, global shapes) with ``model_chunks`` before loading,
    so a checkpoint of another architecture fails with the differences listed; return the stored
    tensors' global shapes by key."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    try:
        stored = {k: tuple(v.global_shape)
                  for k, v in dist_checkpointing.load_tensors_metadata(str(path)).items()}
    except BaseException as err:  # noqa: BLE001 - torch's CheckpointException is a BaseException
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointError(f"checkpoint {path}: tensor metadata (.metadata) could not be read: "
                              f"{_load_failure(err)}") from err
    expected: dict[str, tuple | None] = {}
    for t in nested_values(sharded_state(model_chunks, None, is_loading=True)):
        if isinstance(t, ShardedTensor):
            expected[t.key] = tuple(t.global_shape)
        elif isinstance(t, ShardedBase) and not t.key.endswith("_extra_state"):
            expected[t.key] = None  # factories (SwiGLU fc1): shape checked on load
    missing = sorted(k for k in expected if k not in stored)
    whole = any(unwrap(c).pre_process and unwrap(c).post_process for c in model_chunks)
    # a pipeline stage holds part of the model: stored tensors of other stages are expected
    extra = sorted(k for k in stored if whole and k not in expected and k.startswith(MODEL_PREFIXES))
    shapes = sorted(f"{k} {stored[k]} vs {expected[k]}" for k in expected
                    if k in stored and expected[k] is not None and stored[k] != expected[k])
    if missing or extra or shapes:
        parts = [f"{name}: {', '.join(items[:6])}{' ...' if len(items) > 6 else ''}"
                 for name, items in (("missing", missing), ("unexpected", extra),
                                     ("shape (stored vs model)", shapes)) if items]
        raise CheckpointError(f"checkpoint {path} does not match the model: " + "; ".join(parts))
    return stored


def _first_sentence(err: BaseException) -> str:
    """``err``'s first line, cut after its first sentence when long (torch's zip reader explains at length)."""
    text = str(err).splitlines()[0] if str(err) else ""
    return text.split(". ", 1)[0] if len(text) > 160 else text


def damaged_files(path: Path) -> list[str]:
    """What is wrong with the files of checkpoint ``path``, one phrase each naming the file: a
    ``common.pt`` that does not load, and each ``*.distcp`` file that ``.metadata`` places tensor
    data in and that is missing or shorter than that data. Empty when none is found (or
    ``.metadata`` itself is unreadable: :func:`verify_model_tensors` names it)."""
    bad = []
    try:
        dist_checkpointing.load_common_state_dict(str(path))
    except Exception as err:  # noqa: BLE001 - any failure to load it is what we report
        bad.append(f"{path / 'common.pt'} is damaged or truncated ({type(err).__name__}: {_first_sentence(err)})")
    try:
        from torch.distributed.checkpoint import FileSystemReader

        storage = FileSystemReader(str(path)).read_metadata().storage_data or {}
    except Exception:  # noqa: BLE001
        storage = {}
    need: dict[str, int] = {}
    for info in storage.values():
        rel = getattr(info, "relative_path", None)
        if rel:
            need[rel] = max(need.get(rel, 0), int(info.offset) + int(info.length))
    for rel, size in sorted(need.items()):
        f = path / rel
        if not f.is_file():
            bad.append(f"{f} is missing")
        elif f.stat().st_size < size:
            bad.append(f"{f} is truncated ({f.stat().st_size} bytes; .metadata places data up to byte {size})")
    return bad


def _unwrap_failure(inner):
    inner = getattr(inner, "exc", inner)  # torch wraps each in a _WrappedException
    if isinstance(inner, tuple) and inner and isinstance(inner[0], BaseException):
        inner = inner[0]  # or keeps (exception, traceback frames)
    return inner


def _rank_failures(err: BaseException) -> list:
    """The per-rank exceptions of torch's ``CheckpointException`` (empty for any other error)."""
    failures = getattr(err, "failures", None)
    return [_unwrap_failure(v) for v in failures.values()] if isinstance(failures, dict) else []


def raise_load_error(err: BaseException, path: Path) -> None:
    """Re-raise a failed ``dist_checkpointing.load`` as one :class:`CheckpointError` line; an interrupt
    stays an interrupt, also when torch's reader wrapped it as one rank's failure (a Ctrl-C during a
    load was reported as "could not be read: KeyboardInterrupt on rank 0 (a missing or damaged
    *.distcp ...?)", sending the user after a healthy checkpoint)."""
    if isinstance(err, (KeyboardInterrupt, SystemExit)):
        raise err
    if any(isinstance(e, KeyboardInterrupt) for e in _rank_failures(err)):
        raise KeyboardInterrupt from err
    raise CheckpointError(f"checkpoint {path} could not be read: {_load_failure(err, path)}") from err


def _load_failure(err: BaseException, path: Path | None = None) -> str:
    """One line for a failed ``dist_checkpointing.load``: the damaged files of checkpoint ``path``
    when they can be found (:func:`damaged_files`), else the first per-rank exception of torch's
    ``CheckpointException`` (a missing or truncated ``*.distcp`` file shows up there)."""
    bad = damaged_files(path) if path is not None else []
    if bad:
        more = f" (and {len(bad) - 1} more: {'; '.join(bad[1:3])}{' ...' if len(bad) > 3 else ''})" if len(bad) > 1 else ""
        return f"{bad[0]}{more}"
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, inner = next(iter(failures.items()))
        inner = _unwrap_failure(inner)
        text = f": {_first_sentence(inner)}" if str(inner) else ""
        return f"{type(inner).__name__} on rank {rank}{text} (a missing or damaged *.distcp / .metadata file?)"
    return f"{type(err).__name__}: {_first_sentence(err)}"


def refuse_incomplete(ckpt: "CheckpointManager", what: str) -> None:
    """Refuse to start a run from step 0 in a directory whose ``step_*`` checkpoints are all
    incomplete (the state a partial copy leaves): the run would delete their metrics and, at its
    saves, their folders. Nothing is changed."""
    bad = ckpt.incomplete_checkpoints()
    if not bad or ckpt.complete_checkpoints():
        return
    names = ", ".join(p.name for p in bad[:6]) + (f" (+{len(bad) - 6} more)" if len(bad) > 6 else "")
    missing = sorted({n for p in bad for n in (META, ".metadata", "common.pt") if not (p / n).is_file()})
    raise CheckpointError(
        f"{what}: {ckpt.root} holds only incomplete checkpoints ({names}: missing {', '.join(missing)}; a partial "
        "copy?), so this run would start again from step 0 over them; complete the copy, move those folders "
        "away, or choose another --run-dir (nothing was changed)")


class CheckpointManager:
    """Save/find/load checkpoints under ``root`` keeping the newest ``keep`` complete ones."""

    def __init__(self, root: str | Path, keep: int = 2, retry: str = "then continue with --resume auto"):
        self.root = Path(root)
        self.keep = keep
        self.retry = retry  # what a failed save's message advises (convert --from-hf: run it again)

    # ------------------------------------------------------------ discovery
    def all_step_dirs(self) -> list[Path]:
        """Every ``step_*`` directory under ``root`` (complete or not), oldest first."""
        if not self.root.is_dir():
            return []
        return sorted((p for p in self.root.glob("step_*") if p.is_dir() and step_of(p) >= 0), key=step_of)

    def complete_checkpoints(self) -> list[Path]:
        return [p for p in self.all_step_dirs() if is_complete(p)]

    def incomplete_checkpoints(self) -> list[Path]:
        """``step_*`` directories missing a file a finished save writes (a partial copy, files
        deleted by hand); an interrupted save leaves a hidden ``.tmp_step_*`` instead."""
        return [p for p in self.all_step_dirs() if not is_complete(p)]

    def latest(self) -> Path | None:
        """Newest complete checkpoint. The ``latest`` file is not trusted to name it: it is written
        after the rename that publishes a checkpoint, so a kill between the two leaves it one save
        behind; and resuming an older step moves every newer checkpoint to ``superseded/``
        (:func:`megaloop.train.run_dir.set_aside_newer`) before ``latest`` names it, so the newest
        complete ``step_*`` left under ``root`` always is the head of the run's line."""
        done = self.complete_checkpoints()
        return done[-1] if done else None

    # ------------------------------------------------------------ save
    def save(self, step: int, model_chunks: list, optimizer, common: dict) -> Path:
        """Write checkpoint ``step`` collectively (all ranks call this) and publish it atomically.
        A save the filesystem refuses (disk full, no permission) removes its temporary directory,
        leaves the previous checkpoints and ``latest`` as they were and raises
        :class:`CheckpointSaveError` naming the directory and the OS error."""
        if optimizer is not None:
            _ensure_adam_state(optimizer)  # no update applied yet (every step non-finite): the state before one
            _refuse_unstepped_fused(optimizer, step)
        final = _step_dir(self.root, step)
        tmp = self.root / f".tmp_step_{step:08d}"
        failed: BaseException | None = None
        if _rank() == 0:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                if tmp.exists():
                    shutil.rmtree(tmp)  # a previous interrupted save of this step
                tmp.mkdir()
            except OSError as err:
                failed = err
        if not agree(failed is None):  # collective: every rank raises, none waits in the save
            self._save_failed(step, tmp, failed)
        sd = sharded_state(model_chunks, optimizer, is_loading=False)
        sd["common"] = common
        try:
            with in_process_write_queue():  # no Manager process a group-wide SIGTERM could kill
                dist_checkpointing.save(sd, str(tmp))
        except BaseException as err:  # noqa: BLE001 - torch's CheckpointException is a BaseException
            if isinstance(err, (KeyboardInterrupt, SystemExit)):
                raise
            self._save_failed(step, tmp, err)
        _barrier()
        if _rank() == 0:
            try:
                self._publish(step, tmp, final)
            except OSError as err:
                failed = err
        if not agree(failed is None):
            self._save_failed(step, tmp, failed)
        if _rank() == 0:
            self._prune(step)
        _barrier()
        return final

    def _prune(self, step: int) -> None:
        """Rank 0: keep the newest ``keep`` complete checkpoints up to ``step``; never delete one newer
        than the checkpoint just written (a resume from an older step sets those aside first:
        run_dir.py). Each goes by a rename to a hidden ``.pruned_step_*`` first, so a kill during the
        deletion leaves no half-deleted ``step_*`` that looks like a checkpoint; a ``.pruned_step_*`` a
        kill left behind, and an incomplete ``step_*`` older than every kept checkpoint (a deletion
        interrupted before this release), are removed here too, as is every ``.tmp_step_*``: this save's
        was just renamed to its ``step_*``, so any other is a save a kill cut short (a stop checkpoint
        off the save interval, then SIGKILL after slurm's KillWait), which no later save of that step
        would reuse."""
        kept = [p for p in self.complete_checkpoints() if step_of(p) <= step][-self.keep:]
        oldest = step_of(kept[0]) if kept else step
        doomed = [p for p in self.all_step_dirs() if step_of(p) < oldest]
        for old in doomed:
            gone = self.root / f".pruned_{old.name}"
            try:
                if gone.exists():
                    shutil.rmtree(gone)
                os.rename(old, gone)
            except OSError:
                continue  # left as it was: the next save tries again
        for gone in self.root.glob(".pruned_step_*"):
            shutil.rmtree(gone, ignore_errors=True)
        for gone in self.root.glob(".latest.*.tmp"):  # an atomic write of `latest` a kill cut short
            gone.unlink(missing_ok=True)
        for gone in self.root.glob(".tmp_step_*"):
            shutil.rmtree(gone, ignore_errors=True)

    def _publish(self, step: int, tmp: Path, final: Path) -> None:
        """Rank 0: ``megaloop.json`` into ``tmp``, ``tmp`` renamed to ``final`` (an older copy of
        the same step swapped out, and back in if the rename fails), then ``latest``."""
        meta = {"step": step, "time": time.time(), "complete": True,
                "world_size": torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1,
                "tp": parallel_state.get_tensor_model_parallel_world_size(),
                "pp": parallel_state.get_pipeline_model_parallel_world_size()}
        _atomic_write(tmp / META, json.dumps(meta, indent=1))
        _fsync_dir(tmp)
        trash = None
        if final.exists():  # re-saving a step (e.g. after a resume): swap, then drop the old one
            trash = self.root / f".old_step_{step:08d}"
            if trash.exists():
                shutil.rmtree(trash)
            os.rename(final, trash)
        try:
            os.rename(tmp, final)
        except OSError:
            if trash is not None:
                os.rename(trash, final)
            raise
        # published: `latest` is informative (CheckpointManager.latest picks the newest complete
        # checkpoint), so failing to update it does not fail the save
        try:
            _fsync_dir(self.root)
            _atomic_write(self.root / "latest", final.name)
        except OSError as err:
            print(f"warning: {self.root / 'latest'} not updated ({describe_os_error(err)}); "
                  f"{final} is complete and is the newest checkpoint", flush=True)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)

    def _save_failed(self, step: int, tmp: Path, err: BaseException | None) -> None:
        """Remove the partial ``tmp`` (rank 0) and raise: :class:`CheckpointSaveError` (one line)
        for a failure of the filesystem (:func:`explain_save_failure`), the error itself otherwise
        (a bug keeps its traceback)."""
        why = explain_save_failure(err, tmp if tmp.is_dir() else self.root) if err is not None else \
            "it failed on another rank (see rank 0's error)"
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if why is None:
            raise err
        kept = self.latest()
        raise CheckpointSaveError(
            f"checkpoint step {step} could not be written to {self.root}: {why}; the partial {tmp.name} was "
            f"removed and the previous checkpoints are unchanged "
            f"({'newest ' + kept.name if kept else 'none yet'}); free space or fix the folder, {self.retry}") from None

    # ------------------------------------------------------------ load
    def resolve(self, resume: str) -> Path | None:
        """``auto`` -> latest complete (or None); a path -> that checkpoint (a ``step_*`` dir, or the
        newest complete one of a ``checkpoints`` / run dir, as :func:`find_checkpoint`), validated."""
        path = self.latest() if resume == "auto" else find_checkpoint(resume)
        if path is None:
            refuse_incomplete(self, "--resume auto")
            return None
        return check_meta(path)

    @staticmethod
    def saved_config(path: Path) -> dict:
        """The run config stored with checkpoint ``path`` ({} if unreadable: the load names why)."""
        try:
            common = dist_checkpointing.load_common_state_dict(str(path)).get("common") or {}
        except Exception:  # noqa: BLE001 - only used to explain or pre-check a load
            return {}
        return common.get("config") or {}

    @classmethod
    def saved_model_config(cls, path: Path) -> dict:
        """The ``model`` section of the run config stored with checkpoint ``path`` ({} if unreadable)."""
        return cls.saved_config(path).get("model") or {}

    def load(self, path: Path, model_chunks: list, optimizer=None, strict: bool = True) -> dict:
        """Load model (and optimizer) state in place; returns the ``common`` dict."""
        if not is_complete(path):
            raise CheckpointError(f"checkpoint {path} is incomplete or missing files")
        stored = verify_model_tensors(path, model_chunks)
        if optimizer is not None:
            if not any(k.startswith("optimizer.") for k in stored):
                raise CheckpointError(f"checkpoint {path} holds model weights only, no optimizer state (a checkpoint "
                                      "converted from a Hugging Face folder is one): it cannot resume a training "
                                      f"run; start a new run from its weights with train.init_weights={path}")
            _ensure_adam_state(optimizer)
        sd = sharded_state(model_chunks, optimizer, is_loading=True)
        sd["common"] = None
        repeats = set_repeats_aside(sd)  # parallel.vpp > 1: each chunk's copy of the core
        try:
            loaded = dist_checkpointing.load(sd, str(path))
            fill_repeats(loaded, repeats)
        except BaseException as err:  # torch's CheckpointException derives from BaseException
            raise_load_error(err, path)
        for i, chunk in enumerate(model_chunks):
            load_model_state(unwrap(chunk), loaded[f"model{i}"], strict=strict, where=str(path))
        if optimizer is not None:
            with _keep_adam_step_on_load(optimizer):
                optimizer.load_state_dict(loaded["optimizer"])
            _unshare_adam_steps(optimizer)
        return loaded.get("common") or dist_checkpointing.load_common_state_dict(str(path))["common"]
