#!/usr/bin/env python
"""Plot the learned depth prior's evolution from a run's ``metrics.jsonl``.

    python tools/plot_prior.py --metrics RUN_DIR/metrics.jsonl --out prior.png [--log] [--max-depth N]

Each JSONL line is one optimizer step; lines carrying ``prior_probs`` (probabilities of depths
1..r_max) are plotted as a heatmap (depth × step) with the prior's mean depth overlaid, plus a lower
panel with mean depth and entropy (``prior_mean_depth`` / ``prior_entropy``, computed from the probs
when absent). The step axis uses the ``step`` key when present, else the line's order.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any


class PlotError(RuntimeError):
    """The metrics file is missing, unreadable or holds no prior."""


def load_prior_rows(path: Path) -> list[dict[str, Any]]:
    """Rows (dicts) of ``path`` that carry ``prior_probs``; a truncated LAST line is ignored."""
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(f"metrics file {path} does not exist")
    lines = path.read_text().splitlines()
    rows: list[dict[str, Any]] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            if i == len(lines) - 1:  # a live run may be mid-write
                break
            raise PlotError(f"{path}:{i + 1}: not valid JSON ({err})") from None
        if isinstance(row, dict) and isinstance(row.get("prior_probs"), list) and row["prior_probs"]:
            rows.append(row)
    if not rows:
        raise PlotError(f"{path} has no 'prior_probs' entries (was the run's depth.kind 'learned'?)")
    return rows


def _mean(p: list[float]) -> float:
    return sum((k + 1) * v for k, v in enumerate(p))


def _entropy(p: list[float]) -> float:
    return -sum(v * math.log(v) for v in p if v > 0)


def plot_prior(metrics: Path, out: Path, log_scale: bool = False, max_depth: int | None = None) -> Path:
    """Draw the figure for ``metrics`` into ``out`` (PNG) and return ``out``."""
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
    steps = np.array([r.get("step", i) for i, r in enumerate(rows)], dtype=float)
    mean = np.array([r.get("prior_mean_depth", _mean(r["prior_probs"])) for r in rows], dtype=float)
    ent = np.array([r.get("prior_entropy", _entropy(r["prior_probs"])) for r in rows], dtype=float)

    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    x0, x1 = (steps[0], steps[-1]) if len(steps) > 1 and steps[-1] > steps[0] else (steps[0] - 0.5, steps[0] + 0.5)
    img = np.log10(np.clip(probs, 1e-8, None)) if log_scale else probs
    im = ax.imshow(img.T, origin="lower", aspect="auto", interpolation="nearest",
                   extent=(x0, x1, 0.5, r_max + 0.5), cmap="viridis")
    cax = ax.inset_axes((1.01, 0.0, 0.02, 1.0))  # an inset keeps both panels' x-axes aligned
    fig.colorbar(im, cax=cax, label="log10 p(r)" if log_scale else "p(r)")
    ax.plot(steps, mean, color="white", lw=1.5, label="mean depth")
    ax.set_ylabel("depth r")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    if max_depth:
        ax.set_ylim(0.5, min(max_depth, r_max) + 0.5)
    ax.set_title(f"learned depth prior ({len(rows)} steps, r_max={r_max})")
    ax.legend(loc="upper right")
    ax2.plot(steps, mean, color="C0", label="mean depth")
    ax2.set_ylabel("mean depth", color="C0")
    ax3 = ax2.twinx()
    ax3.plot(steps, ent, color="C1", label="entropy")
    ax3.set_ylabel("entropy (nats)", color="C1")
    ax2.set_xlabel("step")
    fig.subplots_adjust(left=0.09, right=0.88, top=0.94, bottom=0.08, hspace=0.08)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--metrics", required=True, type=Path, help="RUN_DIR/metrics.jsonl (or RUN_DIR)")
    ap.add_argument("--out", default=Path("prior.png"), type=Path, help="output PNG path")
    ap.add_argument("--log", action="store_true", help="colour by log10 probability")
    ap.add_argument("--max-depth", type=int, default=None, help="crop the heatmap to depths 1..N")
    args = ap.parse_args(argv)
    try:
        out = plot_prior(args.metrics, args.out, args.log, args.max_depth)
    except PlotError as err:
        print(f"plot_prior: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
