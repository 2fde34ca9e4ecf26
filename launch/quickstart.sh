#!/usr/bin/env bash
# Main job on the embedded default: set up .venv (first run only), then train the `tiny` looped
# model on the embedded corpus on CPU (or a GPU if present), print the loss curve, and end with a
# depth sweep (validation PPL at R = 1, 2, 4, 8, 16 and the terminal-sharing penalty; table + PNG).
# Extra arguments are passed to `megaloop train` (e.g. train.max_steps=40); the sweep evaluates on
# the run's data.val_path (the embedded validation set by default) and is skipped, with a note, for a
# run on other data without one. A RUN_DIR, a CONFIG file and paths in the overrides are relative to
# your working directory; the default run is the repository's runs/quickstart.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ -z "${RUN_DIR:-}" ] || RUN_DIR="$(realpath -m -- "$RUN_DIR")"
# (a preset name such as tiny stays one, even where a file of that name lies)
case "${CONFIG:-}" in */*|*.yaml|*.yml) CONFIG="$(realpath -m -- "$CONFIG")" ;; esac
source "$ROOT/launch/_setup.sh"
export WANDB_MODE="${WANDB_MODE:-offline}"
RUN_DIR="${RUN_DIR:-$ROOT/runs/quickstart}"
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
# The loop at work: PPL vs recurrence depth (parallel pass, terminal-sharing and per-visit protocols),
# on the run's own validation set (without --data the sweep reads the embedded one, whose tokenizer a
# run on other data does not share: it failed after training)
VAL="$(python - "$RUN_DIR/config.yaml" <<'PY'
import sys, yaml
data = (yaml.safe_load(open(sys.argv[1])) or {}).get("data") or {}
path, val = str(data.get("path") or "default"), data.get("val_path")
print(val if val else ("default" if path == "default" or path.startswith("default:") else ""))
PY
)"
if [ -z "$VAL" ]; then
    echo "depth sweep skipped: the run has no data.val_path; run it with" \
         "megaloop eval sweep --checkpoint $RUN_DIR --data VAL_SET --sharing"
    exit 0
fi
megaloop eval sweep --checkpoint "$RUN_DIR" --data "$VAL" --depths "${SWEEP_DEPTHS:-1,2,4,8,16}" --sharing \
    --max-seqs "${SWEEP_SEQS:-32}" --json "$RUN_DIR/depth_sweep.json" --plot "$RUN_DIR/depth_sweep.png"
