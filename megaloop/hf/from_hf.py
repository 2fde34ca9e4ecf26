"""HF folder → megaloop checkpoint (``megaloop convert --from-hf``): the inverse of
:func:`megaloop.hf.convert.convert_to_hf`, in its own module because it loads the folder through
:mod:`megaloop.hf.load`, which itself builds on :mod:`megaloop.hf.convert`."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from megaloop.hf.convert import ConversionError, hf_to_native_state_dict, native_config_from_hf


def convert_from_hf(hf_dir: str | Path, out_root: str | Path, *, step: int = 0, seed: int = 1234) -> Path:
    """Write an HF folder back as a megaloop checkpoint ``out_root/step_XXXXXXXX`` (TP=1, no optimizer
    state; loadable at any layout) with its tokenizer (:func:`_tokenizer_home`); returns its path.
    An ``out_root`` holding complete checkpoints is refused (step 0 would become their ``latest``)."""
    from megaloop.config import RunConfig
    from megaloop.hf.load import check_model_path, load_model
    from megaloop.model.build import build_model, unwrap
    from megaloop.runtime.parallel import ParallelDims, init_distributed
    from megaloop.train.checkpoint import CheckpointError, CheckpointManager, find_checkpoint, load_model_state

    hf_dir, out_root = Path(hf_dir), Path(out_root)
    try:
        held = find_checkpoint(out_root)
    except CheckpointError:  # missing, or no complete checkpoint there
        held = None
    if held is not None:
        raise ConversionError(f"--out {out_root} already holds megaloop checkpoints (newest: {held}): choose a "
                              "new or empty folder; nothing was written")
    clear_killed_run(hf_dir, out_root)
    if out_root.is_dir() and any(out_root.iterdir()):
        raise ConversionError(f"--out {out_root} is not empty: a checkpoint root (step_00000000, latest) goes into a "
                              "new or empty folder; nothing was written")
    if check_model_path(hf_dir, "--checkpoint") != "hf":  # names a missing, damaged or unknown folder
        raise ConversionError(f"--checkpoint {hf_dir} is not an HF folder; it is a megaloop checkpoint: "
                              f"`megaloop convert --checkpoint {hf_dir} --out DIR` (without --from-hf) exports it")
    tok_home = _tokenizer_home(hf_dir, out_root)
    model = load_model(hf_dir, kind="hf").model  # FP32; a folder without weights is named
    cfg = model.config
    mcfg = native_config_from_hf(cfg)
    init_distributed(ParallelDims(world=1), seed)
    chunks, _ = build_model(mcfg, vocab_size=mcfg.vocab_size, tp=1, pp=1, vpp=None, sequence_parallel=False,
                            seed=seed, ddp=False)
    native = unwrap(chunks[0])
    sd = hf_to_native_state_dict(model.state_dict(), cfg)
    load_model_state(native, sd, strict=True, where=f"{hf_dir} (HF -> megaloop mapping)")
    run = RunConfig(model=mcfg)
    run.train.eval_depth = int(cfg.num_recurrences)  # the folder's default depth stays the default
    dropped = {k: v for k, v in (("prefill_recurrences", cfg.prefill_recurrences), ("decode_recurrences",
               cfg.decode_recurrences), ("kv_cache_mode", cfg.kv_cache_mode)) if v not in (None, "terminal")}
    if dropped:  # HF generate's defaults; a megaloop checkpoint keeps the depth (train.eval_depth) alone
        print(f"warning: {hf_dir}'s config.json sets {', '.join(f'{k}={v}' for k, v in dropped.items())}, which a "
              f"megaloop checkpoint does not keep: the checkpoint (and a re-export) uses depth {cfg.num_recurrences} "
              "and the terminal cache; give them to `megaloop generate` (--prefill-depth, --decode-depth, --cache) "
              "or to the re-export's config", file=sys.stderr, flush=True)
    made_root = not out_root.exists()
    made: list[Path] = []  # tokenizer files this call wrote: removed again if it does not finish
    try:
        if tok_home is not None:  # before the checkpoint, which then never exists without it
            if not tok_home.exists():
                tok_home.mkdir(parents=True)
                made.append(tok_home)
            for name in TOKENIZER_FILES:
                if (hf_dir / name).is_file() and not (tok_home / name).is_file():
                    made.append(tok_home / name)
                    shutil.copyfile(hf_dir / name, tok_home / name)
        return CheckpointManager(out_root, retry="then run the same command again").save(step, chunks, None, common={"step": step, "config": run.to_dict(),
                                                                             "source": str(hf_dir)})
    except BaseException:  # an interrupt or a failure: --out as it was, so the same command can run again
        gone = [*reversed(made), *(out_root.iterdir() if out_root.is_dir() else ())]  # out_root was empty or new
        for p in gone:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
        if made_root and out_root.is_dir():
            out_root.rmdir()
        raise


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def killed_run_leftovers(hf_dir: Path, out_root: Path) -> list[Path] | None:
    """What a ``--from-hf`` of ``hf_dir`` killed before it finished left in ``out_root``: its partial
    ``.tmp_step_*`` folders and the tokenizer files it had copied (equal to ``hf_dir``'s); None when
    ``out_root`` holds anything else (or is empty)."""
    if not out_root.is_dir():
        return None
    entries = list(out_root.iterdir())
    ours = [p for p in entries if (p.name.startswith(".tmp_step_") and p.is_dir()) or
            (p.name in TOKENIZER_FILES and p.is_file() and (hf_dir / p.name).is_file()
             and p.read_bytes() == (hf_dir / p.name).read_bytes())]
    return ours if entries and len(ours) == len(entries) and any(p.name.startswith(".tmp_step_") for p in ours) \
        else None


def clear_killed_run(hf_dir: Path, out_root: Path) -> None:
    """Remove :func:`killed_run_leftovers` (a kill, e.g. SIGKILL, skips the clean-up a failure gets),
    so the same command runs again (it was refused: "--out is not empty")."""
    for p in killed_run_leftovers(Path(hf_dir), Path(out_root)) or ():
        print(f"note: removing {p}, left by an earlier --from-hf that did not finish", file=sys.stderr)
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()


def _tokenizer_home(hf_dir: Path, out_root: Path) -> Path | None:
    """Where :func:`convert_from_hf` copies the folder's tokenizer (None: it has none) for
    :func:`megaloop.hf.convert.find_tokenizer` to find: ``RUN/`` of ``RUN/checkpoints``, else ``out_root`` itself. A
    different tokenizer already there is refused (before anything is written), never overwritten."""
    if not (hf_dir / "tokenizer.json").is_file():
        return None
    home = out_root.parent if out_root.name == "checkpoints" else out_root
    for name in TOKENIZER_FILES:
        src, dst = hf_dir / name, home / name
        if src.is_file() and dst.is_file() and dst.read_bytes() != src.read_bytes():
            raise ConversionError(f"{dst} exists and differs from {src}: convert into another folder")
    return home
