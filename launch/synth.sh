#!/usr/bin/env bash
# The depth-hungry synthetic task in one command: build the programs (data_prep/make_synth.py) and
# their whole-document MDS shards (data_prep/txt360_to_mds.py --packing whole), train the `synth`
# preset on one CPU thread, and print the k x R table of held-out answer accuracy / CE (+ PNG).
#   bash launch/synth.sh [megaloop train overrides, e.g. train.max_steps=300]
# Knobs: DATA_DIR (runs/synth-data) RUN_DIR (runs/synth) NUM_DOCS (60000) THREADS (1)
#        DEPTHS (1,2,3,4,5,6,8,16,32,64) SYNTH_ARGS (extra make_synth.py flags, e.g. "--n-vars 2")
# Data and finished training are reused on a rerun (the run resumes from its last checkpoint).
# A DATA_DIR or RUN_DIR you give is relative to your working directory; the defaults are the repository's.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ -z "${DATA_DIR:-}" ] || DATA_DIR="$(realpath -m -- "$DATA_DIR")"
[ -z "${RUN_DIR:-}" ] || RUN_DIR="$(realpath -m -- "$RUN_DIR")"
# the eval knobs, checked before the data build and the training they would otherwise follow
case "${THREADS:-1}" in '' | *[!0-9]* | 0) echo "launch/synth.sh: THREADS must be an integer >= 1, got '${THREADS:-}'" >&2; exit 2 ;; esac
if ! [[ "${DEPTHS:-1}" =~ ^[0-9]+(,[0-9]+)*$ ]]; then
  echo "launch/synth.sh: DEPTHS must be comma-separated integers (e.g. 1,2,4,8), got '${DEPTHS:-}'" >&2
  exit 2
fi
source "$ROOT/launch/_setup.sh"
cd "$ROOT"
export WANDB_MODE="${WANDB_MODE:-offline}" OMP_NUM_THREADS="${THREADS:-1}"
DATA_DIR="$(realpath -m "${DATA_DIR:-runs/synth-data}")"
RUN_DIR="${RUN_DIR:-runs/synth}"
# the make_synth.py arguments a tree was built with (tree/make_synth_args): a tree built with other
# NUM_DOCS / SYNTH_ARGS is refused, not reused (trees of earlier releases recorded none: reused)
WANT="--num-docs ${NUM_DOCS:-60000} ${SYNTH_ARGS:-}"
if [ -f "$DATA_DIR/tree/synth.json" ]; then
  if [ -f "$DATA_DIR/tree/make_synth_args" ] && [ "$(cat "$DATA_DIR/tree/make_synth_args")" != "$WANT" ]; then
    echo "launch/synth.sh: $DATA_DIR/tree was built with make_synth.py '$(cat "$DATA_DIR/tree/make_synth_args")', not '$WANT' (NUM_DOCS, SYNTH_ARGS): give another DATA_DIR, or remove $DATA_DIR to rebuild it" >&2
    exit 2
  fi
  if ! python -c 'import json, sys; from megaloop.data.synth import GENERATOR, tree_generator
sys.exit(tree_generator(json.load(open(sys.argv[1]))) < GENERATOR)' "$DATA_DIR/tree/synth.json"; then
    echo "launch/synth.sh: $DATA_DIR/tree was made by an earlier make_synth.py, whose training programs could begin with a held-out program and show its answer: remove $DATA_DIR to rebuild it (and $RUN_DIR, which trained on it), or give another DATA_DIR and RUN_DIR" >&2
    exit 2
  fi
else
  rm -rf "$DATA_DIR/tree.tmp"
  # shellcheck disable=SC2086
  python data_prep/make_synth.py --out "$DATA_DIR/tree.tmp" --num-docs "${NUM_DOCS:-60000}" ${SYNTH_ARGS:-}
  printf '%s\n' "$WANT" > "$DATA_DIR/tree.tmp/make_synth_args"
  rm -rf "$DATA_DIR/tree" && mv "$DATA_DIR/tree.tmp" "$DATA_DIR/tree"
fi
python data_prep/txt360_to_mds.py --input "$DATA_DIR/tree" --out "$DATA_DIR/train" \
    --tokenizer "$DATA_DIR/tree/tokenizer" --seq-len 128 --packing whole \
    --val-fraction 0 --screen-fraction 0 --workers 2 --no-progress   # skipped when already built
megaloop train --config synth --run-dir "$RUN_DIR" --resume auto data.path="$DATA_DIR/train" "$@"

megaloop eval synth --checkpoint "$RUN_DIR" --problems "$DATA_DIR/tree/heldout.jsonl" \
    --depths "${DEPTHS:-1,2,3,4,5,6,8,16,32,64}" --threads "${THREADS:-1}" \
    --json "$RUN_DIR/synth_table.json" --plot "$RUN_DIR/synth_table.png"
