"""What a training run may do to its ``--run-dir`` before it trains: nothing already written is
lost, and no setting is silently ignored.

- :class:`RunDirLock`: one run per run directory (an exclusive ``flock`` on ``RUN/.megaloop.lock``
  held by rank 0 for the run's lifetime; released by the kernel if the process dies).
- :func:`finish_interrupted_publish`: a re-save of a step killed between its two renames is
  finished (or undone) once the lock is held, before any rank looks for the checkpoint to resume.
- :func:`check_fresh_start`: a run started without ``--resume`` refuses a directory that holds
  another run's checkpoints (``--resume auto`` continues it).
- :func:`check_resume_source` / :func:`set_aside_newer`: resuming from a checkpoint of this run
  directory that is older than its newest moves the newer ones to ``checkpoints/superseded/``
  (kept, never pruned) so the resumed run's saves and ``latest`` form one line of history;
  resuming another directory's checkpoint into a directory holding checkpoints is refused, and so
  is resuming one of ``superseded/`` over the current line (saying so); resuming another
  directory's checkpoint into one without checkpoints sets its ``metrics.jsonl`` aside.
- :func:`check_saved_optim`: the ``optim.*`` fields the checkpoint's optimizer and scheduler
  state would override on load must equal the checkpoint's, else one line names each field.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from megaloop.config_utils import ConfigError
from megaloop.train.checkpoint import CheckpointError, CheckpointManager, refuse_incomplete, step_of
from megaloop.train.ckpt_io import agree as _agree

LOCK_NAME = ".megaloop.lock"
SUPERSEDED = "superseded"  # checkpoints of an abandoned line, kept (never pruned)
# optimizer/scheduler fields a checkpoint restores on load (param groups, scheduler state); a new
# value would be ignored, so a resume must keep them. clip_grad is read from the config each step.
RESTORED_OPTIM_FIELDS = ("lr", "min_lr", "weight_decay", "beta1", "beta2", "eps", "schedule", "warmup_steps")
# the WSD decay's shape: megatron's scheduler state does not hold it (schedule.py rebuilds it from the
# config), so a new value would reshape the schedule the trained steps followed; compared under wsd only
WSD_SHAPE_FIELDS = ("decay_fraction", "decay_style")


class RunDirError(CheckpointError):
    """The run directory is in use or holds another run's checkpoints; the message names it."""


class RunDirLock:
    """Exclusive lock on ``run_dir`` taken by rank 0 (``acquire`` is collective: every rank raises
    :class:`RunDirError` when rank 0 could not take it)."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_NAME
        self.fd: int | None = None
        self.created = False  # rank 0 made the run directory (release may remove it again)

    def acquire(self, rank: int, held: Callable[[], None] | None = None) -> None:
        """Collective: rank 0 takes the lock (else :class:`RunDirError` on every rank) and then, before the
        other ranks go on, runs ``held`` (repairs only the lock holder may make, e.g.
        :func:`finish_interrupted_publish`)."""
        holder, taken, unusable, fd = "", False, "", None
        if rank == 0:
            try:
                self.created = not self.path.parent.exists()
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            except OSError as err:  # a file or dangling link in the way, no permission: every rank raises below
                from megaloop.runtime.files import dangling_link, nearest_existing

                unusable = dangling_link(nearest_existing(self.path.parent)) or f"{err.strerror}: {err.filename}"
        if not _agree(not unusable):
            raise RunDirError(f"--run-dir {self.path.parent}: cannot be used as a run directory "
                              f"({unusable or 'on rank 0'})")
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # held by another process
                os.close(fd)
                taken = True
                try:
                    holder = self.path.read_text().strip()
                except OSError:
                    holder = ""
            except OSError as err:  # a filesystem without flock: run unlocked, say so
                os.close(fd)
                print(f"warning: {self.path}: could not lock the run directory ({err.strerror}); "
                      "make sure no other run uses it", flush=True)
                if held is not None:
                    held()
            else:
                from megaloop.data._fsutil import lock_holder  # "pid N on HOST", as data-prep locks say

                self.fd = fd
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{lock_holder()}\n".encode(), 0)
                if held is not None:
                    held()
        if not _agree(not taken):
            who = f" ({holder})" if holder else ""
            raise RunDirError(f"--run-dir {self.path.parent}: another megaloop run is using it{who}; wait for it "
                              f"to end or choose another --run-dir (lock {self.path})")

    def check_held(self, what: str, collective: bool = True) -> None:
        """Collective (unless ``collective=False``): raise :class:`RunDirError` on every rank when rank 0's
        lock file is no longer the one it locked (the run directory was removed or replaced while training). A save there
        recreated the folder, without its lock, so another run could take it and both wrote into it.
        ``collective=False``: rank 0 alone checks (after a failed save, when the other ranks may still
        wait inside megatron's save: a collective here deadlocked the job)."""
        lost = False
        if self.fd is not None:
            try:
                held, now = os.fstat(self.fd), os.stat(self.path)
                lost = (held.st_dev, held.st_ino) != (now.st_dev, now.st_ino)
            except OSError:
                lost = True
        if not (_agree(not lost) if collective else not lost):
            raise RunDirError(f"--run-dir {self.path.parent}: removed or replaced while this run trained (its lock "
                              f"{self.path} is gone); stopping without {what}, so that no other run's files are "
                              "written over")

    def release(self, discard_unused: bool = False) -> None:
        """Drop the lock; with ``discard_unused`` (a run refused during set-up) also remove the
        run directory again when this run created it and it holds nothing but the lock file."""
        if self.fd is None:
            return
        os.close(self.fd)  # closing the descriptor drops the flock
        self.fd = None
        if discard_unused and self.created and [p.name for p in self.path.parent.iterdir()] == [LOCK_NAME]:
            self.path.unlink()
            self.path.parent.rmdir()


def finish_interrupted_publish(ckpt: CheckpointManager) -> None:
    """Rank 0, the run directory locked: finish a re-save of a step that a kill cut between its two
    renames (:meth:`CheckpointManager._publish`: ``step_N`` -> ``.old_step_N``, ``.tmp_step_N`` ->
    ``step_N``), which left no ``step_N``: the resume went back to an older checkpoint, the next save
    deleted the new copy and ``.old_step_N`` stayed for good. The complete new copy is published, else
    the old one is put back; a ``.old_step_N`` beside its ``step_N`` is removed. One line each; a
    failure warns (the resume then starts from the newest ``step_*`` as before)."""
    from megaloop.train.checkpoint import is_complete

    for old in sorted(ckpt.root.glob(".old_step_*")) if ckpt.root.is_dir() else ():
        final, new = ckpt.root / old.name[len(".old_"):], ckpt.root / f".tmp_{old.name[len('.old_'):]}"
        try:
            if final.exists():
                if is_complete(final):  # published; the kill came before the old copy's removal
                    shutil.rmtree(old)
                else:  # not this rename's doing (a partial copy, files deleted): left to the user
                    print(f"warning: {old} kept: {final} is incomplete", flush=True)
                continue
            use = new if new.is_dir() and is_complete(new) else old
            os.rename(use, final)
            if use is new:
                shutil.rmtree(old)
            print(f"{final.name}: a save of it was cut short between its renames; "
                  f"{'its new copy' if use is new else 'the copy it replaced'} is {final} again", flush=True)
        except OSError as err:
            print(f"warning: {old} left as it is ({err.strerror}): a save of {final.name} was cut short; "
                  f"move it to {final} to resume from it", flush=True)


def check_run_dir_location(run_dir: Path, data_paths: dict[str, str | None], *, flag: str = "--run-dir",
                           writes: str = "a run writes checkpoints and logs there") -> None:
    """``run_dir`` must not be a dataset or lie inside one (``data_paths``: config field or flag ->
    path): a run writes checkpoints, metrics and a lock file there (``lr-screen``/``reproduce`` their
    runs and reports: ``flag`` names the option). An MDS dataset (``index.json`` or ``manifest.json``)
    or a raw TxT360-layout tree (``data/<source>/…/*.jsonl[.gz]``) is refused before anything is written."""
    rd = Path(run_dir).resolve()  # as the run uses it: a quoted "~/x" is a folder named "~" (as in a shell)
    for field, path in data_paths.items():
        if not path or str(path).startswith("default") or "://" in str(path) or not Path(path).exists():
            continue  # the embedded corpus (built in the cache), a remote dataset, or one the loader will name
        dp = Path(path).expanduser().resolve()
        if rd == dp or dp in rd.parents:
            raise RunDirError(f"{flag} {run_dir} is {'' if rd == dp else 'inside '}the dataset {field}={path}: "
                              f"{writes}; choose another {flag} (nothing was written)")
    if not rd.is_dir():
        return
    for name in ("index.json", "manifest.json"):
        if (rd / name).is_file():
            raise RunDirError(f"{flag} {run_dir} holds {name}: it is a dataset folder, not "
                              f"{'a run directory' if flag == '--run-dir' else 'an output folder'}; "
                              f"choose another {flag} (nothing was written)")
    raw = rd / "data"
    if raw.is_dir() and any(f.name.endswith((".jsonl", ".jsonl.gz")) for pattern in ("*/*", "*/*/*")
                            for f in raw.glob(pattern)):
        raise RunDirError(f"{flag} {run_dir} holds a raw text tree ({raw}/<source>/…/*.jsonl): choose another "
                          f"{flag} (nothing was written)")


def check_fresh_start(ckpt: CheckpointManager, run_dir: Path) -> None:
    """A run started without ``--resume`` must not write into a directory holding checkpoints."""
    done = ckpt.complete_checkpoints()
    if done:
        raise RunDirError(f"--run-dir {run_dir} already holds a run's checkpoints (newest {done[-1].name}): "
                          "continue it with --resume auto (or --resume PATH), or choose another --run-dir; "
                          "nothing there was changed")
    refuse_incomplete(ckpt, f"--run-dir {run_dir}")


def check_resume_source(ckpt: CheckpointManager, run_dir: Path, path: Path) -> None:
    """Resuming ``path`` into ``run_dir``: a checkpoint from elsewhere needs a directory without
    checkpoints (its saves and pruning would otherwise mix two runs' histories). A checkpoint of
    this directory's ``superseded/`` is another line of this run: resuming it over the current
    checkpoints would prune or overwrite those (the very ones that superseded it), so it is
    refused saying so, with the ways to resume it."""
    done = ckpt.complete_checkpoints()
    if not done:  # another run's checkpoint: its saves would replace incomplete step_* folders here
        refuse_incomplete(ckpt, f"--run-dir {run_dir}")
        return
    if path.resolve().parent == ckpt.root.resolve():
        return
    aside = (ckpt.root / SUPERSEDED).resolve()
    if aside in path.resolve().parents:
        raise RunDirError(f"--resume {path} is a checkpoint this run set aside in {ckpt.root / SUPERSEDED} when an "
                          f"older step was resumed; resuming it here would mix its line with the current checkpoints "
                          f"(newest {done[-1].name}), which its saves would prune or overwrite: resume it into a new "
                          f"--run-dir, or first move {ckpt.root}'s step_* folders away (nothing was changed)")
    raise RunDirError(f"--resume {path} is not a checkpoint of --run-dir {run_dir}, which holds another run's "
                      f"checkpoints (newest {done[-1].name}): resume it into an empty --run-dir, "
                      "or resume this directory's own checkpoints")


def set_aside_newer(ckpt: CheckpointManager, path: Path, on_rewind: Callable[[], None] | None = None) -> list[Path]:
    """Move the checkpoints of ``ckpt.root`` newer than ``path`` (one of its own) into
    ``root/superseded/`` and point ``latest`` at ``path``; returns the new locations. Rank 0 only.
    Resuming a checkpoint of another directory (allowed only when this one holds no complete
    checkpoint) sets this directory's ``metrics.jsonl`` aside instead (:func:`set_aside_metrics`).
    ``on_rewind()`` runs first whenever the run continues another line of history than its newest
    checkpoint's (either case; the trainer replaces the wandb run id there): once a checkpoint has
    moved, nothing on disk says that a later launch continues a rewound run."""
    if path.resolve().parent != ckpt.root.resolve():
        if on_rewind is not None:
            on_rewind()
        set_aside_metrics(ckpt.root.parent, path)
        return []
    step = step_of(path)
    newer = [p for p in ckpt.all_step_dirs() if step_of(p) > step]
    moved = []
    if newer:
        if on_rewind is not None:
            on_rewind()
        dest = ckpt.root / SUPERSEDED
        try:
            dest.mkdir(exist_ok=True)
            for p in newer:
                target = dest / p.name
                if target.exists():
                    target = dest / f"{p.name}.{int(time.time())}"
                os.rename(p, target)  # same filesystem: a folder moves whole or not at all
                moved.append(target)
        except OSError as err:
            from megaloop.runtime.files import describe_os_error

            done = f" ({', '.join(m.name for m in moved)} already moved there)" if moved else ""
            raise RunDirError(f"--resume {path}: the newer checkpoints could not be set aside in {dest}{done}: "
                              f"{describe_os_error(err)}") from None
    latest = ckpt.root / "latest"
    if moved or latest.is_file():
        from megaloop.runtime.files import atomic_write_text

        try:
            if moved or latest.read_text().strip() != path.name:  # rewritten only when it changes
                atomic_write_text(latest, path.name)
        except OSError as err:  # informative only (resume reads the folders): a full or read-only disk
            from megaloop.runtime.files import describe_os_error  # fails the first save, with its own line

            print(f"warning: {latest} could not be updated to {path.name} ({describe_os_error(err)})", flush=True)
    log = ckpt.root.parent / "metrics.jsonl"
    if moved and log.is_file():  # the log's lines after `step` go with the set-aside line of history
        from megaloop.runtime.files import atomic_write_file

        kept = _kept_name(log)
        atomic_write_file(kept, lambda tmp: shutil.copyfile(log, tmp))
        print(f"resuming from an older step: the metrics of the set-aside steps stay in {kept.name} (a copy of "
              f"metrics.jsonl; the log itself continues from step {step})", flush=True)
    return moved


def _kept_name(log: Path) -> Path:
    """``metrics.jsonl.<date-time>`` beside ``log`` (``.2``, ``.3``, ... when taken)."""
    target = log.with_name(f"metrics.jsonl.{time.strftime('%Y%m%d-%H%M%S')}")
    n = 1
    while target.exists():
        n += 1
        target = log.with_name(f"metrics.jsonl.{time.strftime('%Y%m%d-%H%M%S')}.{n}")
    return target


def set_aside_metrics(run_dir: Path, source: Path) -> Path | None:
    """Resuming another run's checkpoint ``source`` into ``run_dir``: an existing
    ``metrics.jsonl`` there (e.g. of a run killed before its first checkpoint) is not this
    history's: it moves to ``metrics.jsonl.<time>`` (printed), and the log restarts at the resumed
    step. Not deleted — a Megatron/torchtitan user expects a run's logs to be kept, and one log per
    line of history (a truncating append would leave the old run's steps 1..k in front of the
    resumed run's k+1.., with different losses and totals). Rank 0; returns the new path."""
    log = Path(run_dir) / "metrics.jsonl"
    if not log.is_file():
        return None
    target = _kept_name(log)
    os.replace(log, target)
    print(f"resuming another run's checkpoint {source}: the metrics already in {run_dir} belong to another "
          f"history and were moved to {target.name} (kept)", flush=True)
    return target


def check_saved_layout(path: Path, saved: dict, cfg) -> None:
    """The settings a resume's load would fail on without naming them, checked before it
    (``saved``: the checkpoint's run config, {} when unreadable: the load names why)."""
    check_saved_optimizer_layout(path, saved.get("parallel") or {}, cfg.parallel)
    check_saved_seq_len(path, saved.get("model") or {}, cfg.model)
    check_saved_precision(path, saved.get("model") or {}, cfg.model)


def check_saved_precision(path: Path, saved: dict, model) -> None:
    """Refuse, before loading, a resume under another ``model.bf16`` or ``model.fp8``: it trained on in
    the other precision and rewrote ``config.yaml`` as if the whole run had (a plain optimizer's state
    failed to load with a KeyError traceback, or was blamed on damaged files). ``saved``: the
    checkpoint's ``model`` section (a field it lacks is not checked)."""
    diffs = [(k, saved[k], getattr(model, k)) for k in ("bf16", "fp8")
             if k in saved and (saved[k] or None) != (getattr(model, k) or None)]
    if diffs:
        what = ", ".join(f"model.{k}={_yaml_value(old)} (this run: {_yaml_value(new)})" for k, old, new in diffs)
        keep = " ".join(f"model.{k}={_yaml_value(old)}" for k, old, _ in diffs)
        raise ConfigError(f"checkpoint {path} was trained with {what}; resume with {keep}, or start a new run "
                          f"in the other precision from its weights in a new --run-dir with train.init_weights={path}")


def _yaml_value(v) -> str:
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def check_saved_seq_len(path: Path, saved: dict, model) -> None:
    """Refuse, before loading, a resume under another ``model.seq_len``: the data position counts
    samples of the checkpoint's length (it failed as "data loader state was saved on a different
    dataset", not naming the field). ``saved``: the checkpoint's ``model`` section."""
    old = saved.get("seq_len")
    if old is not None and int(old) != int(model.seq_len):
        raise ConfigError(f"checkpoint {path} was trained with model.seq_len={old} (this run: {model.seq_len}); its "
                          f"data position counts {old}-token samples: resume with model.seq_len={old}, or start a "
                          f"new run from its weights in a new --run-dir with train.init_weights={path}")


def check_saved_optimizer_layout(path: Path, saved: dict, parallel) -> None:
    """Refuse, before loading, a resume that switches ``parallel.distributed_optimizer``: megatron
    stores the distributed optimizer's state by flattened buffer, the plain one by parameter, and
    neither loads the other (a KeyError traceback one way, a misleading "damaged file" the other).
    ``saved``: the checkpoint's ``parallel`` section ({} for a checkpoint without one: not checked)."""
    old = saved.get("distributed_optimizer")
    if old is not None and bool(old) != bool(parallel.distributed_optimizer):
        raise ConfigError(f"checkpoint {path} holds {'distributed' if old else 'plain'} optimizer state "
                          f"(parallel.distributed_optimizer={str(bool(old)).lower()}; this run: "
                          f"{str(bool(parallel.distributed_optimizer)).lower()}), which the other optimizer cannot "
                          f"load; resume with parallel.distributed_optimizer={str(bool(old)).lower()}, or start a "
                          f"new run from its weights in a new --run-dir with train.init_weights={path}")


def check_saved_optim(path: Path, saved: dict, optim) -> None:
    """Refuse a resume whose ``optim.*`` differs from the checkpoint's in a field the checkpoint's
    optimizer/scheduler state would override (the new value would be silently ignored), or, under
    the WSD schedule, in the decay's shape (rebuilt from the config: it would reshape the schedule the
    trained steps followed). ``decay_*`` of a cosine or constant schedule are unused: not compared."""
    if not saved:
        return  # a checkpoint written before configs were stored with it: nothing to compare
    fields = RESTORED_OPTIM_FIELDS + (WSD_SHAPE_FIELDS if saved.get("schedule", "wsd") == "wsd" else ())
    diffs = [(k, saved[k], getattr(optim, k)) for k in fields if k in saved and saved[k] != getattr(optim, k)]
    if diffs:
        what = ", ".join(f"optim.{k}={old!r} (this run: {new!r})" for k, old, new in diffs)
        keep = " ".join(f"optim.{k}={old}" for k, old, _ in diffs)
        why = [reason for reason, names in (
            ("its optimizer and schedule state would override the new value(s)", RESTORED_OPTIM_FIELDS),
            ("the WSD decay is rebuilt from the config, so the new value(s) would reshape the schedule its "
             "trained steps followed", WSD_SHAPE_FIELDS)) if any(k in names for k, _, _ in diffs)]
        raise ConfigError(f"checkpoint {path} was trained with {what}; {'; '.join(why)}. Resume with {keep}, or "
                          "extend the horizon with train.max_steps alone")


INIT_ONLY_FIELDS = (("depth", "init"), ("train", "init_seed"), ("train", "init_weights"))


def check_saved_seeds(path, saved: dict, cfg) -> None:
    """Refuse a resume under another ``train.seed`` or ``data.shuffle_seed``: the checkpoint's
    depth sampler and data position keep its seeds, while h⁰ noise would take the new one (the
    loader refuses another ``data.num_canonical_nodes``)."""
    diffs = [f"{sec}.{key}={old} (this run: {new})" for sec, key in (("train", "seed"), ("data", "shuffle_seed"))
             if (old := (saved.get(sec) or {}).get(key)) is not None
             and old != (new := getattr(getattr(cfg, sec), key))]
    if diffs:
        keep = " ".join(d.split(" (")[0] for d in diffs)
        raise ConfigError(f"checkpoint {path} was trained with {', '.join(diffs)}; its depth sampler and data "
                          f"order keep the checkpoint's seeds. Resume with {keep}, or start a new run")


def init_only_changes(saved: dict, cfg) -> str | None:
    """The note for a resume that changed a field which only sets up a new run's initial state
    (the prior's init, the initial weights' seed or source): the checkpoint brings its own, so the
    new value has no effect although the run's ``config.yaml`` records it. None when none changed
    (or the checkpoint's config lacks the field: saved before it existed)."""
    diffs = [f"{sec}.{key}={new} (checkpoint: {old})" for sec, key in INIT_ONLY_FIELDS
             if key in (saved.get(sec) or {}) and (new := getattr(getattr(cfg, sec), key)) is not None
             and (old := saved[sec][key]) != new]  # a value dropped on resume (None) asks for nothing
    if not diffs:
        return None
    return (f"note: {', '.join(diffs)} set up a new run's initial state; a resume continues the checkpoint's, so "
            "these have no effect here and config.yaml keeps the checkpoint's values (start a new --run-dir "
            "to use them)")


def keep_init_fields(saved: dict, cfg) -> None:
    """Set ``cfg``'s :data:`INIT_ONLY_FIELDS` to the checkpoint's (``saved``, its config) in place, so
    the resumed run's ``config.yaml`` records the initial state the run has: re-running that file
    trains the same run (it recorded a changed or dropped value that had no effect)."""
    for sec, key in INIT_ONLY_FIELDS:
        if key in (saved.get(sec) or {}):
            setattr(getattr(cfg, sec), key, saved[sec][key])
    # null resumes with the checkpoint's partition: config.yaml names it (a re-run of null at another DP
    # size would derive another one)
    data = saved.get("data") or {}
    if cfg.data.num_canonical_nodes is None and "num_canonical_nodes" in data:
        cfg.data.num_canonical_nodes = data["num_canonical_nodes"]


def vocab_hint(err: Exception, vocab: int, cfg, saved_model: dict | None = None) -> str:
    """What to add to a checkpoint load's shape error that is about the vocabulary (the embedding or
    output-layer shapes): another padding multiple when the checkpoint's ``saved_model`` config says
    so, else this run's vocabulary and where it came from; '' for any other error."""
    if "word_embeddings" not in str(err) and "output_layer" not in str(err):
        return ""
    multiple = (saved_model or {}).get("vocab_pad_multiple")
    if isinstance(multiple, int) and multiple != cfg.model.vocab_pad_multiple:
        return (f"; the checkpoint pads its vocabulary to a multiple of {multiple}, this run to "
                f"{cfg.model.vocab_pad_multiple}: use model.vocab_pad_multiple={multiple}")
    source = "model.vocab_size" if cfg.model.vocab_size else f"the data manifest of data.path={cfg.data.path}"
    return (f"; its vocabulary differs from this run's ({vocab} tokens, from {source}): train on data tokenised "
            "with the checkpoint's tokenizer, with the checkpoint's model.vocab_size")
