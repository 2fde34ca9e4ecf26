"""The parity harness's options (``tools/bench/parity.py``): the parser, the checks made before
anything trains or loads, and the command recorded with each result (the reference checkout's path
masked)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path


def build_parser(doc: str, presets: list[str], out_default: str) -> argparse.ArgumentParser:
    """``parity.py``'s options (``doc``: its help text; ``presets``: the ``--preset`` names)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--system", choices=("megaloop", "huginn", "parcae"))
    p.add_argument("--ref-path", help="root of a checkout of the reference repository (huginn/parcae)")
    p.add_argument("--preset", default="default", help=f"megaloop config by name: {presets}")
    p.add_argument("--base", default="tiny", help="megaloop preset the shape and data come from")
    p.add_argument("--label", help="result name (default: system[_preset])")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps (the schedule's horizon; default 300)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    p.add_argument("--batch", type=int, default=16, help="sequences per step (default 16)")
    p.add_argument("--micro-batch", type=int, default=8,
                   help="megaloop's micro batch; one depth draw each (default 8; divides --batch)")
    p.add_argument("--seed", type=int, default=1234, help="batches, depth draws, init (default 1234)")
    p.add_argument("--init-seed", type=int, default=None,
                   help="seed of the initial weights alone (default: --seed; megaloop: train.init_seed; a "
                        "reference: torch's seed before it builds its model, so also its training-time "
                        "h^0 draws); batches, depth draws and evaluation noise stay those of --seed")
    p.add_argument("--mean-depth", type=float, default=5.0, help="mean training depth of every system (default 5)")
    p.add_argument("--huginn-mean", choices=("matched", "native"), default="matched",
                   help="Huginn's sampler draws R = Poisson(λ) + 1 with E[λ] = its mean_recurrence, so "
                        "E[R] = mean_recurrence + 1. matched (default): mean_recurrence = --mean-depth - 1, "
                        "the same mean depth as the other systems; native: mean_recurrence = --mean-depth "
                        "(E[R] one higher; every Huginn result before this option existed)")
    p.add_argument("--bptt-window", type=int, default=4, help="recurrences that backpropagate (default 4)")
    p.add_argument("--depths", type=int, nargs="+", default=[1, 2, 5, 64],
                   help="validation depths (default 1 2 5 64)")
    p.add_argument("--zero-init-depths", type=int, nargs="+", default=[1, 5],
                   help="depths also evaluated from h^0 = 0 (control for noise that recurrences wash out)")
    p.add_argument("--trace-depth", type=int, default=8, help="depth of the state diagnostics (default 8)")
    p.add_argument("--trace-seqs", type=int, default=16,
                   help="validation sequences the state diagnostics trace (default 16)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--out", default=out_default,
                   help="result folder (default tools/bench/results/parity)")
    p.add_argument("--report", metavar="DIR", help="render parity.md/png from the results in DIR and exit")
    p.add_argument("--check-forward", metavar="MODEL",
                   help="copy the weights of this megaloop model (run directory or HF export; a matched "
                        "config) into --system's reference and compare logits at --depths from h^0 = 0; "
                        "writes OUT/<label>.json, exits 1 if they differ by more than --forward-tol")
    p.add_argument("--forward-tol", type=float, default=1e-3, help="max |logit difference| for --check-forward")
    p.add_argument("--check-training", metavar="STEPS", type=int,
                   help="train --preset (a Huginn-matched config) and Huginn's code from the same initial "
                        "weights, batches and fixed depth with h^0 = 0 for the first STEPS steps of the "
                        "--steps protocol and compare the per-step losses (parity_train_check.py); writes "
                        "OUT/<label>.json, exits 1 if they differ by more than --train-tol")
    p.add_argument("--check-depth", type=int, default=5, help="the fixed depth of --check-training")
    p.add_argument("--train-tol", type=float, default=1e-3, help="max |loss difference| for --check-training")
    p.add_argument("--add-copying", nargs=2, metavar=("RUN", "RESULT"),
                   help="measure the in-context copying probe on a megaloop run's final checkpoint, write it "
                        "into that run's result JSON, and exit")
    p.add_argument("overrides", nargs="*", help="extra megaloop config overrides (key=value)")
    return p


_AT_LEAST_ONE = ("batch", "micro_batch", "bptt_window", "trace_depth", "trace_seqs", "threads")


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace, configs: dict[str, list[str]],
               protocol=lambda args: []) -> None:
    """``p.error`` (one line, exit 2) for an option that would fail later: several failed only after the
    whole training run (``--trace-depth 0``, ``--depths -1``), whose rerun was then refused."""
    if args.steps < 2:  # the warm-up takes max(1, 10 %) of the steps and must end before the horizon
        p.error(f"--steps: must be >= 2 (the warm-up's step must end before the schedule's horizon), got {args.steps}")
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

        try:  # an unknown or bad override, or one at odds with the protocol's (protocol(args)): one line now,
            # not a traceback when the run starts
            load_config(args.base, protocol(args) + configs.get(args.preset, []) + list(args.overrides))
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
