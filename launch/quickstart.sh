#!/usr/bin/env bash
# Main job on the embedded default: set up .venv (first run only), then train the `tiny` looped
# model on the embedded corpus on CPU (or a GPU if present), print the loss curve, and end with a
# depth sweep (validation PPL at R = 1, 2, 4, 8, 16 and the terminal-sharing penalty; table + PNG).
# Extra arguments are passed to `megaloop train` (e.g. train.max_steps=40).
# A RUN_DIR or CONFIG file you give is relative to your working directory; the default run is the
# repository's runs/quickstart.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ -z "${RUN_DIR:-}" ] || RUN_DIR="$(realpath -m -- "$RUN_DIR")"
# (a preset name such as tiny stays one, even where a file of that name lies)
case "${CONFIG:-}" in */*|*.yaml|*.yml) CONFIG="$(realpath -m -- "$CONFIG")" ;; esac
source "$ROOT/launch/_setup.sh"
cd "$ROOT"
export WANDB_MODE="${WANDB_MODE:-offline}"
RUN_DIR="${RUN_DIR:-runs/quickstart}"
megaloop train --config "${CONFIG:-tiny}" --run-dir "$RUN_DIR" --resume auto "$@"
python - "$RUN_DIR" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(f"{sys.argv[1]}/metrics.jsonl")]
first, last = rows[0], rows[-1]
k = max(1, len(rows) // 10)
head = sum(r["loss"] for r in rows[:k]) / k
tail = sum(r["loss"] for r in rows[-k:]) / k
print(f"steps {first['step']}..{last['step']}: mean loss of first {k} steps {head:.3f} -> last {k} steps {tail:.3f}")
if "val_ce" in last:
    print(f"validation CE at depth {last.get('val_depth')}: {last['val_ce']:.3f} (ppl {last['val_ppl']:.1f})")
print(f"run directory: {sys.argv[1]} (metrics.jsonl, config.yaml, checkpoints/)")
PY
# The loop at work: PPL vs recurrence depth (parallel pass, terminal-sharing and per-visit protocols)
megaloop eval sweep --checkpoint "$RUN_DIR" --depths "${SWEEP_DEPTHS:-1,2,4,8,16}" --sharing \
    --max-seqs "${SWEEP_SEQS:-32}" --json "$RUN_DIR/depth_sweep.json" --plot "$RUN_DIR/depth_sweep.png"
