"""The parity harness's argument checks (``tools/bench/parity.py``), made before anything trains or
loads, and the command recorded with each result (the reference checkout's path masked)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

_AT_LEAST_ONE = ("steps", "batch", "micro_batch", "bptt_window", "trace_depth", "trace_seqs", "threads")


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace, configs: dict[str, list[str]]) -> None:
    """``p.error`` (one line, exit 2) for an option that would fail later: several failed only after the
    whole training run (``--trace-depth 0``, ``--depths -1``), whose rerun was then refused."""
    for name in _AT_LEAST_ONE:
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    for name in ("depths", "zero_init_depths"):
        bad = [d for d in getattr(args, name) if d < 1]
        if bad:
            p.error(f"--{name.replace('_', '-')}: depths are >= 1, got {bad}")
    if args.batch % args.micro_batch:
        p.error(f"--micro-batch: {args.micro_batch} does not divide --batch {args.batch}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        p.error(f"--lr: must be a number > 0, got {args.lr}")
    if not (math.isfinite(args.mean_depth) and args.mean_depth >= 1):
        p.error(f"--mean-depth: must be >= 1, got {args.mean_depth}")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        p.error(f"--out: {args.out} is a file, not a folder")
    if args.ref_path and args.system == "megaloop" and not args.check_forward:
        p.error("--ref-path: --system megaloop trains no reference (name --system huginn or parcae)")
    if args.system == "megaloop" and args.overrides:
        from megaloop.config import load_config
        from megaloop.errors import UserError

        try:  # an unknown or bad override: one line now, not a traceback when the run starts
            load_config(args.base, configs.get(args.preset, []) + list(args.overrides))
        except UserError as err:
            p.error(f"override: {err}")


def masked_command(argv: list[str], **paths: str | None) -> str:
    """``python tools/bench/parity.py ARGS`` with each argument equal to one of ``paths`` (name ->
    path) replaced by the name (``REF_PATH``, ``MODEL``); an --out or --label that merely contains
    the path as text was rewritten too."""
    masks = {str(v): k for k, v in paths.items() if v}
    shown = [masks.get(a, a) for a in argv]
    return " ".join(["python tools/bench/parity.py"] + [a if " " not in a else repr(a) for a in shown])


def reference_mean_recurrence(args) -> int:
    """The reference's ``mean_recurrence`` setting for a training mean depth of ``--mean-depth``.
    Parcae's sampler has that mean; Huginn's ``poisson-lognormal-filling`` draws Poisson(λ) + 1 with
    E[λ] = mean_recurrence, so ``--huginn-mean matched`` passes one less (see ``--huginn-mean``)."""
    mean = int(args.mean_depth)
    if mean != args.mean_depth:
        raise SystemExit(f"--mean-depth: the references take an integer mean depth, got {args.mean_depth}")
    if args.system == "huginn" and args.huginn_mean == "matched":
        if mean < 2:
            raise SystemExit(f"--mean-depth: Huginn's sampler has E[R] >= 2 (Poisson + 1), got {args.mean_depth}")
        return mean - 1
    return mean
