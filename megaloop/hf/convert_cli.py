"""``megaloop convert`` (also ``python tools/convert_to_hf.py``): a megaloop training checkpoint
(any TP/PP layout; a step dir, ``RUN/checkpoints`` or ``RUN``) → a Hugging Face folder that loads
with ``trust_remote_code`` and without megaloop, validated (:mod:`megaloop.hf.convert`); or back
with ``--from-hf``. Exit status 2 with one line on bad input or failed validation.

    megaloop convert --checkpoint RUN/checkpoints/step_00001000 --out hf/ [--dtype bf16] [--no-validate]
    megaloop convert --from-hf --checkpoint hf/ --out RUN_BACK/checkpoints
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from megaloop.runtime.files import nonempty_path


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="megaloop convert", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, type=nonempty_path, help="checkpoint step dir, checkpoints dir or run dir "
                    "(with --from-hf: the HF folder)")
    ap.add_argument("--out", required=True, type=nonempty_path, help="output HF folder (with --from-hf: checkpoints root)")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="saved weight dtype")
    ap.add_argument("--no-validate", action="store_true", help="skip the native-vs-HF logits check")
    ap.add_argument("--tokenizer", default=None, help="tokenizer.json (or its dir); default: from the run")
    ap.add_argument("--depth", type=int, default=None,
                    help="default depth written to config.json (default: the run's train.eval_depth)")
    ap.add_argument("--max-shard-size", default="2GB", help="largest weights file: e.g. 2GB, 500MB, or bytes")
    ap.add_argument("--from-hf", action="store_true", help="convert an HF folder back to a megaloop checkpoint")
    return ap


SIZE_UNITS = {"": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}  # huggingface_hub's (decimal)


def shard_size(value: str) -> int:
    """``--max-shard-size`` in bytes: a number of bytes, or of KB/MB/GB/TB as huggingface_hub reads
    it (``2GB``, ``0.5 GB``); :class:`ConfigError` naming the flag otherwise."""
    from megaloop.config_utils import ConfigError

    m = re.fullmatch(r"(\d+\.?\d*|\.\d+)\s*([KMGT]B)?", value.strip(), re.IGNORECASE)
    size = int(float(m[1]) * SIZE_UNITS[(m[2] or "").upper()]) if m else 0
    if size < 1:
        raise ConfigError(f"--max-shard-size {value!r}: not a size; use e.g. 2GB, 500MB or a number of bytes")
    return size


def _checkpoint_folder(p: Path) -> bool:
    """``p`` is a megaloop checkpoint (``step_*`` with its files) or a folder of them (``latest``,
    ``step_*`` checkpoints)."""
    if p.name.startswith(("step_", ".tmp_step_")) and ((p / "megaloop.json").is_file() or (p / ".metadata").is_file()):
        return True
    try:
        return (p / "latest").is_file() or any(
            (c / "megaloop.json").is_file() or (c / ".metadata").is_file() for c in p.glob("step_*"))
    except OSError:
        return False


def _check_out_location(out: Path) -> None:
    """An output must not lie inside a checkpoints folder (it would mix with the checkpoints, and go
    with them when they are pruned or set aside) or inside an HF export (the next export there
    replaces that folder, and it with it), and must be creatable: the nearest existing folder
    above it (where it is staged and renamed into place) is probed with a temporary file, created and
    removed at once (:func:`megaloop.runtime.files.cannot_create_in`)."""
    import os

    from megaloop.config_utils import ConfigError
    from megaloop.runtime.files import cannot_create_in, nearest_existing

    absolute = Path(os.path.abspath(out))
    for p in absolute.parents:
        if p.is_dir() and _checkpoint_folder(p):
            raise ConfigError(f"--out {out} lies inside the checkpoint folder {p}: the export would mix with its "
                              "checkpoints; choose a folder outside it; nothing was written")
        if (p / "megaloop_conversion.json").is_file():  # re-exporting p would delete what is written here
            raise ConfigError(f"--out {out} lies inside the Hugging Face export {p}: the next export there "
                              "would replace the folder and this with it; choose a folder outside it; "
                              "nothing was written")
    probe = nearest_existing(absolute.parent)
    why = cannot_create_in(probe)
    if why:
        raise ConfigError(f"--out {out}: {probe} is not writable (cannot create a file in it: {why}); "
                          "nothing was loaded or written")


def _check_args(args) -> None:
    """Before any loading: a sane --depth and --max-shard-size (made bytes), and an --out that
    nothing else lives in (an HF export written into a run or checkpoint directory would shadow its
    checkpoints for every later ``--checkpoint RUN``), that lies in no checkpoints folder or export and
    that can be created (:func:`_check_out_location`). An earlier export (it holds
    megaloop_conversion.json, and nothing an export does not write: :func:`~megaloop.hf.convert.foreign_entries`)
    may be replaced. With --from-hf, --out must be new or empty (convert_from_hf
    also refuses a folder holding checkpoints)."""
    from megaloop.config_utils import ConfigError
    from megaloop.runtime.files import dangling_link, nearest_existing

    if args.from_hf:  # the export's options mean nothing going back: refused, not ignored
        given = [flag for flag, on in (("--dtype", args.dtype != "fp32"), ("--no-validate", args.no_validate),
                                       ("--tokenizer", args.tokenizer is not None), ("--depth", args.depth is not None),
                                       ("--max-shard-size", args.max_shard_size != "2GB")) if on]
        if given:
            raise ConfigError(f"{given[0]}: applies to the export (megaloop -> HF); --from-hf takes only "
                              "--checkpoint (the HF folder) and --out")
    if args.depth is not None and args.depth < 1:
        raise ConfigError(f"--depth: must be >= 1, got {args.depth}")
    if args.depth is not None and not args.from_hf:
        from megaloop.hf.load import model_arch

        if model_arch(args.checkpoint) == "untied":  # as eval and generate refuse it
            raise ConfigError(f"--depth: {args.checkpoint} is an untied (non-looped) model, it has no depth to vary")
    args.max_shard_size = shard_size(args.max_shard_size)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder")
    parent = nearest_existing(out)
    if link := dangling_link(parent):
        raise ConfigError(f"--out {out}: {link}; nothing was loaded or written")
    if not parent.is_dir():
        raise ConfigError(f"--out {out}: {parent} is a file, not a folder")
    if out.resolve() == Path(args.checkpoint).resolve():
        raise ConfigError(f"--out {out} is the --checkpoint folder itself: choose a new or empty folder")
    _check_out_location(out)
    if not out.exists() or not any(out.iterdir()):
        return
    if args.from_hf:  # checkpoints go into a folder of their own (a run's checkpoints/, or a new one)
        from megaloop.hf.from_hf import killed_run_leftovers

        if killed_run_leftovers(Path(args.checkpoint), out) is not None:
            return  # an earlier --from-hf of the same folder was killed: convert_from_hf clears it
        raise ConfigError(f"--out {out} is not empty: --from-hf writes a checkpoint root (step_00000000, latest) "
                          "into a new or empty folder; nothing was written")
    held = [p.name for p in out.iterdir() if p.name == "latest" or p.name.startswith(("step_", ".tmp_step_"))]
    if held or not (out / "megaloop_conversion.json").is_file():
        why = f"holds megaloop checkpoints ({', '.join(sorted(held)[:3])})" if held else \
            "is not empty and is not an earlier megaloop export (no megaloop_conversion.json)"
        raise ConfigError(f"--out {out} {why}: choose a new or empty folder; nothing was written")
    from megaloop.hf.convert import foreign_entries

    foreign = foreign_entries(out)
    if foreign:  # a model card, notes, a checkpoint converted back into it: replacing the export deletes them
        raise ConfigError(f"--out {out} is an earlier export that also holds {', '.join(foreign[:3])}"
                          f"{' ...' if len(foreign) > 3 else ''}, which no export writes: replacing it would "
                          "delete them; move them out or choose another --out; nothing was written")


def main(argv: list[str] | None = None) -> int:
    """Run ``megaloop convert``; a :class:`~megaloop.errors.UserError` exits 2 with one line."""
    from megaloop.errors import UserError, report
    from megaloop.hf.convert import convert_to_hf
    from megaloop.hf.from_hf import convert_from_hf

    args = build_parser().parse_args(argv)
    try:
        _check_args(args)
        if args.from_hf:
            print(f"wrote megaloop checkpoint {convert_from_hf(args.checkpoint, args.out)}")
            return 0
        rep = convert_to_hf(args.checkpoint, args.out, dtype=args.dtype, validate=not args.no_validate,
                            tokenizer=args.tokenizer, num_recurrences=args.depth,
                            max_shard_size=args.max_shard_size)
    except UserError as err:
        return report(err, "megaloop convert")
    print(f"wrote {args.out} from {rep['checkpoint']} (step {rep['step']}, {rep['seconds']} s)")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
