"""Run folders of the post-training commands: what an ``--out`` holds, and the checkpoint facts a
``--resume`` is checked against before anything loads.

* :func:`folder_holds` tells whose folder ``--out`` is — a pretraining run (``megaloop train``), an
  RL run (``megaloop rl``), a prefill student (``megaloop distill-prefill``), an HF model, or nothing
  known — from its files alone. ``--overwrite`` and ``--resume`` act only on the command's own runs.
* Next to each checkpoint (``OUT/checkpoints/stepNNNNNN``) rank 0 writes a small JSON *sidecar*
  (``rl_run.json`` / ``distill_run.json``): the step, the run's settings, the process count, the
  engine and the training seconds so far, readable before the model loads.
  :func:`checkpoint_facts` reads it (or, for checkpoints written before the sidecar, what the
  checkpoint files themselves tell) and :func:`check_layout` refuses a resume on another engine, or
  on another process count unless the checkpoint is a DeepSpeed ZeRO-1/2/3 one (converted to
  DeepSpeed's universal checkpoint then), in one line.
"""

from __future__ import annotations

import json
from pathlib import Path

from megaloop.config_utils import ConfigError

RL_SIDECAR = "rl_run.json"
DISTILL_SIDECAR = "distill_run.json"

# what each command calls its own runs (for messages) and the kind folder_holds gives them
OWN = {"rl": "an RL run", "student": "a prefill student"}

_MODEL_FILES = ("model.safetensors", "config.json", "pytorch_model.bin", "model.safetensors.index.json")


def _first_record(path: Path) -> dict | None:
    """The first JSON object of a metrics.jsonl (None: absent, empty or unreadable)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.strip():
                    rec = json.loads(line)
                    return rec if isinstance(rec, dict) else None
    except (OSError, ValueError):
        return None
    return None


def _rel(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


def folder_holds(out: str | Path) -> tuple[str, str] | None:
    """``(kind, what)`` for a folder that holds something: ``kind`` one of ``pretraining``, ``rl``,
    ``student``, ``hf`` (an HF model that is no RL run), ``run`` (a metrics.jsonl of no known tool),
    ``lr-screen`` / ``reproduce`` (a sweep command's folder) or ``unknown-run`` (a metrics.jsonl with no
    readable record: an interrupted run of either command),
    ``what`` the words naming it with the files that tell (``"a pretraining run (config.yaml,
    checkpoints/step_00003200/megaloop.json)"``). None for a missing or an empty/unrelated folder."""
    out = Path(out)
    if not out.is_dir():
        return None
    # megaloop train: a checkpoint step dir, a checkpoints dir, a run dir (config.yaml + checkpoints/metrics)
    if (out / "megaloop.json").is_file() and (out / "common.pt").exists():
        return "pretraining", "a pretraining checkpoint (megaloop.json, common.pt)"
    for base in (out, out / "checkpoints"):
        steps = sorted(base.glob("step_*/megaloop.json"))
        if steps:
            held = ", ".join(x for x in ("config.yaml",) if (out / x).is_file())
            return "pretraining", (f"a pretraining run ({held + ', ' if held else ''}"
                                   f"{_rel(steps[-1], out)})")
    metrics = out / "metrics.jsonl"
    rec = _first_record(metrics) if metrics.is_file() else None
    if (out / "config.yaml").is_file() and (metrics.exists() or (out / "checkpoints").is_dir()):
        return "pretraining", "a pretraining run (config.yaml" + (", metrics.jsonl)" if metrics.exists() else ")")
    # megaloop distill-prefill
    for name in ("student.json", "student.safetensors"):
        if (out / name).exists():
            return "student", f"a prefill student ({name})"
    side = sorted(out.glob(f"checkpoints/step*/{DISTILL_SIDECAR}"))
    if side:
        return "student", f"an interrupted prefill-student run ({_rel(side[-1], out)})"
    # megaloop rl
    if (out / "megaloop_rl.json").exists():
        return "rl", "an RL run (megaloop_rl.json, an HF model)"
    side = sorted(out.glob(f"checkpoints/step*/{RL_SIDECAR}"))
    if side:
        return "rl", f"an interrupted RL run ({_rel(side[-1], out)})"
    if rec is not None:  # checkpoints written before the sidecars: the records tell the tool
        if "reward_mean" in rec:
            return "rl", "an RL run (metrics.jsonl of GRPO steps)"
        if "hidden" in rec and "kl" in rec:
            return "student", "an interrupted prefill-student run (metrics.jsonl of distillation steps)"
    held = [m for m in _MODEL_FILES if (out / m).exists()]
    if held:
        return "hf", f"a model ({' / '.join(held)})"
    if rec is not None:
        return "run", f"the metrics.jsonl of a run of another tool (record keys: {', '.join(list(rec)[:6])})"
    if metrics.exists():
        return "unknown-run", "a run (metrics.jsonl)"
    for kind, marker, what in SWEEP_MARKERS:  # the sweep commands' folders (their runs lie in subfolders)
        if (out / marker).is_file():
            return kind, f"{what} ({marker})"
    return None


# the markers of `megaloop lr-screen` / `reproduce` folders (megaloop.sweep_out.folder_kind reads them too)
SWEEP_MARKERS = (("lr-screen", "screen.json", "an LR screen"), ("reproduce", "plan.json", "a reproduce experiment"))


def check_owner(out: Path, own: str, *, resume: bool, overwrite: bool) -> str | None:
    """Refuse (:class:`ConfigError`) an ``--out`` that holds another tool's folder, whatever the flags:
    ``own`` is ``rl`` or ``student``. Returns the kind held (``own``, ``unknown-run`` or None)."""
    held = folder_holds(out)
    if held is None:
        return None
    kind, what = held
    if kind in (own, "unknown-run"):
        return kind
    mine = OWN[own]
    if kind == "hf" and own == "rl":  # the wording tests and users know: the markers of a run named
        raise ConfigError(f"--out {out} holds {what} but no marker of a run (metrics.jsonl / megaloop_rl.json); "
                          f"refusing to overwrite it (--overwrite only replaces {mine}): give another --out")
    why = ("--resume cannot continue it" if resume else "--overwrite would destroy it" if overwrite
           else "writing there would mix the two")
    raise ConfigError(f"--out {out} holds {what}, not {mine}: {why} (--resume and --overwrite act only on "
                      f"{mine}); give another --out")


def sidecar_fields(state: dict, tool: str, engine, **more) -> dict:
    """A checkpoint's sidecar (:func:`write_sidecar`): the client ``state`` saved with it, the command
    (``tool``: ``megaloop rl`` / ``megaloop distill-prefill``), the ``engine``'s process count, kind
    (``plain`` / ``deepspeed``) and ZeRO stage, then ``more`` (``megaloop rl``: its ``--deepspeed``)."""
    return {**state, "tool": tool, "world_size": engine.world,
            "engine": "plain" if engine.stage is None else "deepspeed", "zero_stage": engine.stage, **more}


def write_sidecar(ckpt: str | Path, tag: str, name: str, payload: dict) -> None:
    """``ckpt/tag/name``: the checkpoint's facts as JSON, written whole (rank 0, before the save, which
    then moves ``latest``: a step folder ``latest`` names always has its sidecar)."""
    from megaloop.runtime.files import atomic_write_text

    d = Path(ckpt) / tag
    d.mkdir(parents=True, exist_ok=True)
    atomic_write_text(d / name, json.dumps(payload, indent=1, default=str))


def save_checkpoint(engine, ckpt: str | Path, tag: str, state: dict, sidecar: str, fields: dict) -> None:
    """Rank 0 writes ``ckpt/tag/<sidecar>`` (``fields``: readable before a model loads), then ``engine``
    saves ``state`` and moves ``latest``, so ``latest`` never names a step without its sidecar. A save
    that fails or is interrupted (a second Ctrl-C during the stop's save) has rank 0 remove the step
    folder it made, which ``latest`` never named: it stayed, empty or with the sidecar alone."""
    import shutil

    d = Path(ckpt) / tag
    made = engine.rank == 0 and not d.exists()
    try:
        if engine.rank == 0:
            write_sidecar(ckpt, tag, sidecar, fields)
        engine.save(ckpt, tag, state)
    except BaseException:
        if made and latest_tag(Path(ckpt)) != tag:
            shutil.rmtree(d, ignore_errors=True)
        raise


def latest_tag(ckpt: Path) -> str | None:
    f = Path(ckpt) / "latest"
    try:
        return f.read_text().strip() or None if f.is_file() else None
    except OSError:
        return None


def resume_tag(ckpt: Path) -> str:
    """The tag ``ckpt/latest`` names, checked to exist (:class:`ConfigError` otherwise)."""
    ckpt = Path(ckpt)
    tag = latest_tag(ckpt)
    if tag is None:
        raise ConfigError(f"--resume: no checkpoint in {ckpt} (no 'latest' file)")
    if not (ckpt / tag).is_dir():
        raise ConfigError(f"--resume: {ckpt / 'latest'} names checkpoint {tag!r}, but {ckpt / tag} does not exist "
                          f"(deleted or moved?); restore it, or write the tag of a checkpoint that exists into "
                          f"{ckpt / 'latest'}")
    return tag


def saved_world(tag_dir: Path) -> tuple[str, int] | None:
    """``(engine, processes)`` a checkpoint folder was written by, from its files: ``plain`` (one
    process, ``plain.pt``) or ``deepspeed`` (one ZeRO optimizer shard per process); None if unknown."""
    if (tag_dir / "plain.pt").is_file():
        return "plain", 1
    shards = list(tag_dir.glob("*zero_pp_rank_*_mp_rank_*_optim_states.pt"))
    if shards:
        return "deepspeed", len(shards)
    if (tag_dir / "mp_rank_00_model_states.pt").is_file():
        return "deepspeed", 0  # processes unknown
    return None


def checkpoint_facts(ckpt: Path, tag: str, sidecar: str) -> dict:
    """What the checkpoint ``ckpt/tag`` records, read without building a model: its sidecar
    (``sidecar``) when there is one, else the client state a checkpoint written before the sidecars
    stored (``plain.pt`` / DeepSpeed's ``mp_rank_00_model_states.pt``). Always with ``engine`` and
    ``world_size`` when the files tell them."""
    d = Path(ckpt) / tag
    facts: dict = {}
    side = d / sidecar
    if side.is_file():
        try:
            facts = json.loads(side.read_text())
        except (OSError, ValueError):
            raise ConfigError(f"--resume: {side}: not valid JSON (a damaged checkpoint sidecar)") from None
        if not isinstance(facts, dict):
            raise ConfigError(f"--resume: {side}: not a JSON object (a damaged checkpoint sidecar)")
    else:
        for name in ("plain.pt", "mp_rank_00_model_states.pt"):
            f = d / name
            if not f.is_file():
                continue
            import zipfile

            import torch

            try:  # a zip (torch.save's format): mapped, so the weights and optimizer state are not read in
                state = torch.load(f, map_location="cpu", weights_only=False, mmap=zipfile.is_zipfile(f))
            except Exception as err:  # noqa: BLE001 - a damaged file
                first = str(err).splitlines()[0] if str(err) else repr(err)
                raise ConfigError(f"--resume: {f}: unreadable ({first})") from None
            client = state.get("client_state") if name == "plain.pt" else state
            facts = {k: client.get(k) for k in ("step", "config", "meta", "sigma2", "run", "seconds")
                     if isinstance(client, dict) and k in client}
            break
    files = saved_world(d)
    if files is not None:
        facts.setdefault("engine", files[0])
        if files[1]:
            facts.setdefault("world_size", files[1])
    return facts


def checkpoint_tool(facts: dict) -> str | None:
    """``rl`` / ``student`` for the command whose checkpoint ``facts`` (:func:`checkpoint_facts`) are
    from: GRPO's client state has the config's ``arm`` and a ``meta``, distillation's a ``sigma2`` / ``run``."""
    tool = facts.get("tool")
    if tool in ("megaloop rl", "megaloop distill-prefill"):
        return "rl" if tool == "megaloop rl" else "student"
    if "sigma2" in facts or "run" in facts:
        return "student"
    if "meta" in facts or "arm" in (facts.get("config") or {}):
        return "rl"
    return None


def check_tool(facts: dict, where: str, own: str) -> None:
    """Refuse a ``--resume`` from a checkpoint of the other command (one line, before anything loads)."""
    tool = checkpoint_tool(facts)
    if tool is not None and tool != own:
        prog = "megaloop rl" if tool == "rl" else "megaloop distill-prefill"
        raise ConfigError(f"--resume: {where} is a checkpoint of {OWN[tool]} ({prog}), not of {OWN[own]}; "
                          "give another --out")


def check_layout(facts: dict, where: str, *, world: int, deepspeed: str | None) -> None:
    """Refuse a resume on another engine than the checkpoint's, or on another process count unless it
    is a ZeRO-1/2/3 checkpoint (which loads through DeepSpeed's universal checkpoint) (one line)."""
    engine = facts.get("engine")
    if engine == "plain" and deepspeed is not None:
        raise ConfigError(f"--resume: {where} was saved without --deepspeed (one process, plain AdamW); resume "
                          f"without --deepspeed, or start a fresh --out")
    if engine == "deepspeed" and deepspeed is None:
        raise ConfigError(f"--resume: {where} is a DeepSpeed checkpoint; resume with the --deepspeed it was "
                          "saved with")
    old = facts.get("world_size")
    if engine == "deepspeed" and facts.get("zero_stage") in (1, 2, 3):
        return  # another process count: converted to DeepSpeed's universal checkpoint (megaloop.post.universal)
    if isinstance(old, int) and old > 0 and old != world:
        raise ConfigError(f"--resume: {where} was saved with {old} process{'es' if old != 1 else ''}, now {world}: "
                          f"resume with {old} (torchrun --nproc_per_node {old}); a ZeRO checkpoint's optimizer "
                          "shards are tied to the process count")


def check_writable(out: Path) -> None:
    """Refuse an ``--out`` this process cannot create or write into (one line), before anything loads:
    the folder itself when it exists (and its ``checkpoints``), else the nearest folder above it that
    exists. Each is probed with a temporary file (created and removed at once): permission bits alone
    do not tell for root, a read-only mount or a pseudo file system such as ``/sys``."""
    from megaloop.runtime.files import cannot_create_in, dangling_link, nearest_existing

    out = Path(out)
    probe = nearest_existing(out)
    if link := dangling_link(probe):
        raise ConfigError(f"--out {out}: {link}; give a folder you can write to")
    if out.exists():
        targets = [out] + ([out / "checkpoints"] if (out / "checkpoints").is_dir() else [])
    else:
        targets = [probe]
    for t in targets:
        if not t.is_dir():
            continue
        why = cannot_create_in(t)
        if why is not None:
            where = "" if t == out else f" (cannot create it in {t}: {why})" if t == probe else f" ({t}: {why})"
            raise ConfigError(f"--out {out}: not writable{where or f' ({why})'}; give a folder you can write to")


def interrupted_line(prog: str, out: str | Path | None) -> str:
    """The one line for Ctrl-C: ``--resume`` is named only when ``OUT/checkpoints`` has a checkpoint."""
    if not out:  # no run folder (``megaloop rl grad-check``)
        return f"{prog}: interrupted"
    ckpt = Path(out) / "checkpoints"
    if latest_tag(ckpt) is not None:
        return f"{prog}: interrupted (continue from its last checkpoint in {ckpt} with --resume)"
    return f"{prog}: interrupted (no checkpoint was written, nothing to --resume: run it again)"


def cut_metrics(path: Path, step: int) -> int:
    """Keep the records of ``path`` (a run's ``metrics.jsonl``) before ``step``: those of later steps,
    which the resume from the checkpoint of ``step`` redoes, and a torn last line go. The file is
    replaced whole (atomically), never left half-written; returns how many records went."""
    from megaloop.runtime.files import atomic_write_text

    path = Path(path)
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            keep = isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] < step
        except ValueError:
            keep = False
        if keep:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        atomic_write_text(path, "".join(k + "\n" for k in kept))
    return dropped
