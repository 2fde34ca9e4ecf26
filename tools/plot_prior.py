#!/usr/bin/env python
"""Plot the learned depth prior's evolution from a run's ``metrics.jsonl``.

    python tools/plot_prior.py --metrics RUN_DIR/metrics.jsonl --out prior.png [--log] [--max-depth N]

Each JSONL line is one optimizer step; lines carrying ``prior_probs`` (probabilities of depths
1..r_max) are plotted as a heatmap (depth × step) with the prior's mean depth overlaid, plus a lower
panel with mean depth and entropy (``prior_mean_depth`` / ``prior_entropy``, computed from the probs
when absent). Lines are read as every megaloop tool reads the log: a torn line (a killed run) is
skipped, and a step written twice (a run resumed from an earlier checkpoint appends the steps it
repeats) counts once, the later record winning. The figure's format follows ``--out``'s suffix
(.png, .pdf, .svg); ``--out`` must not be one of the run's own files.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class PlotError(RuntimeError):
    """The metrics file is missing, unreadable or holds no prior."""


def load_prior_rows(path: Path) -> list[dict[str, Any]]:
    """Rows (dicts) of ``path`` that carry ``prior_probs``, one per step in step order (a repeated
    step: the later record wins; torn lines are skipped, as :func:`megaloop.train.metrics.read_metrics`)."""
    from megaloop.train.summary import read_metrics

    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(f"metrics file {path} does not exist")
    rows = [r for r in read_metrics(path) if isinstance(r.get("prior_probs"), list) and r["prior_probs"]]
    if not rows:
        raise PlotError(f"{path} has no 'prior_probs' entries (was the run's depth.kind 'learned'?)")
    return rows


FORMATS = (".png", ".pdf", ".svg")


def check_out(out: Path, metrics: Path) -> None:
    """``out`` can be written, has a figure suffix and is not one of the run's own files."""
    from megaloop.config_utils import ConfigError
    from megaloop.inference.generate_cli import check_out_file
    from megaloop.train.summary import is_run_file

    run = metrics if metrics.is_dir() else metrics.parent
    log = metrics / "metrics.jsonl" if metrics.is_dir() else metrics
    if is_run_file(out, run) or out.resolve() == log.resolve():
        raise PlotError(f"--out {out}: is one of the run's own files; write the figure elsewhere "
                        f"(e.g. {run / 'prior.png'})")
    if out.suffix.lower() not in FORMATS:
        raise PlotError(f"--out {out}: the suffix must be one of {', '.join(FORMATS)} (the figure's format)")
    try:
        check_out_file(str(out), "--out")
    except ConfigError as err:
        raise PlotError(str(err)) from None


def _mean(p: list[float]) -> float:
    return sum((k + 1) * v for k, v in enumerate(p))


def _entropy(p: list[float]) -> float:
    return -sum(v * math.log(v) for v in p if v > 0)


def plot_prior(metrics: Path, out: Path, log_scale: bool = False, max_depth: int | None = None) -> Path:
    """Draw the figure for ``metrics`` into ``out`` (format from its suffix) and return ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    import numpy as np

    rows = load_prior_rows(Path(metrics))
    r_max = max(len(r["prior_probs"]) for r in rows)
    probs = np.zeros((len(rows), r_max))
    for i, r in enumerate(rows):
        probs[i, : len(r["prior_probs"])] = r["prior_probs"]
    steps = np.array([r["step"] for r in rows], dtype=float)
    mean = np.array([r.get("prior_mean_depth", _mean(r["prior_probs"])) for r in rows], dtype=float)
    ent = np.array([r.get("prior_entropy", _entropy(r["prior_probs"])) for r in rows], dtype=float)

    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    # one column per logged step, centred on it and reaching halfway to its neighbours (steps may be
    # unevenly spaced: log_interval, a resume; uniform columns drifted off their steps)
    xs = np.asarray(steps, dtype=float)
    mids = (xs[1:] + xs[:-1]) / 2
    edges = np.concatenate([[xs[0] - (mids[0] - xs[0] if len(xs) > 1 else 0.5)], mids,
                            [xs[-1] + (xs[-1] - mids[-1] if len(xs) > 1 else 0.5)]])
    img = np.log10(np.clip(probs, 1e-8, None)) if log_scale else probs
    im = ax.pcolormesh(edges, np.arange(r_max + 1) + 0.5, img.T, cmap="viridis", shading="flat",
                       rasterized=True)  # one image in SVG/PDF, not a shape per cell (94 MB for 8,000 steps)
    cax = ax.inset_axes((1.01, 0.0, 0.02, 1.0))  # an inset keeps both panels' x-axes aligned
    fig.colorbar(im, cax=cax, label="log10 p(r)" if log_scale else "p(r)")
    dot = "o" if len(steps) == 1 else None  # one logged step: a line of one point draws nothing
    ax.plot(steps, mean, color="white", lw=1.5, marker=dot, label="mean depth")
    ax.set_ylabel("depth r")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    if max_depth:
        ax.set_ylim(0.5, min(max_depth, r_max) + 0.5)
    span = f"steps {int(steps[0])}-{int(steps[-1])}" if len(rows) > 1 else f"step {int(steps[0])}"
    ax.set_title(f"learned depth prior ({span}, {len(rows)} logged, r_max={r_max})")  # it said "3 steps" for 30
    ax.legend(loc="upper right")
    ax2.plot(steps, mean, color="C0", marker=dot, label="mean depth")
    ax2.set_ylabel("mean depth", color="C0")
    ax3 = ax2.twinx()
    ax3.plot(steps, ent, color="C1", marker=dot, label="entropy")
    ax3.set_ylabel("entropy (nats)", color="C1")
    ax2.set_xlabel("step")
    fig.subplots_adjust(left=0.11, right=0.88, top=0.94, bottom=0.08, hspace=0.08)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.stem}.tmp-{os.getpid()}{out.suffix}")  # whole or not at all
    try:
        fig.savefig(tmp, dpi=110)
        os.replace(tmp, out)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return out


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--metrics", required=True, type=Path, help="RUN_DIR/metrics.jsonl (or RUN_DIR)")
    ap.add_argument("--out", default=Path("prior.png"), type=Path, help="output figure (.png, .pdf or .svg)")
    ap.add_argument("--log", action="store_true", help="colour by log10 probability")
    ap.add_argument("--max-depth", type=_positive, default=None, help="crop the heatmap to depths 1..N")
    args = ap.parse_args(argv)
    try:
        check_out(args.out, args.metrics)
        out = plot_prior(args.metrics, args.out, args.log, args.max_depth)
    except PlotError as err:
        print(f"plot_prior: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"plot_prior: error: --out {args.out}: cannot be written ({err.strerror or err})", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
