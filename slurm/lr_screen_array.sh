#!/usr/bin/env bash
# One learning-rate screen point per array task. Submitted by tools/lr_screen.py --launcher slurm,
# which writes $SCREEN_POINTS_DIR/point_<i>.args (i = the point's index in the grid; line 1: config,
# line 2: run dir, then one dotlist override per line: optim.lr, train.stop_after, data.val_path,
# ...) and runs, with SCREEN_DIR and SCREEN_POINTS_DIR in the environment,
#   sbatch --array=0-(n-1) --export=ALL slurm/lr_screen_array.sh
# Each task trains `megaloop train --resume auto` on its own allocation (slurm/common.sh: NODES,
# GPUS_PER_NODE, rendezvous, requeue on SIGUSR1) and records the exit status in RUN_DIR/screen_exit.
#SBATCH --job-name=megaloop-lrscreen
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
set -euo pipefail

_here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ROOT=""
for _c in "${MEGALOOP_ROOT:-}" "$_here" "${SLURM_SUBMIT_DIR:-}"; do
  if [ -n "$_c" ] && [ -f "$_c/slurm/common.sh" ]; then ROOT="$(cd "$_c" && pwd)"; break; fi
done
[ -n "$ROOT" ] || { echo "megaloop-slurm: error: repository not found: sbatch from its root or set MEGALOOP_ROOT" >&2; exit 2; }
# shellcheck source=slurm/common.sh
source "$ROOT/slurm/common.sh"

[ -n "${SCREEN_DIR:-}" ] || megaloop_die "SCREEN_DIR is not set: submit through tools/lr_screen.py --launcher slurm"
[ -n "${SLURM_ARRAY_TASK_ID:-}" ] || megaloop_die "SLURM_ARRAY_TASK_ID is not set: submit as an array job (sbatch --array=...)"
ARGS_FILE="${SCREEN_POINTS_DIR:-$SCREEN_DIR/slurm}/point_${SLURM_ARRAY_TASK_ID}.args"
[ -f "$ARGS_FILE" ] || megaloop_die "no point file $ARGS_FILE (array index outside the screen's grid?)"
mapfile -t POINT <"$ARGS_FILE"
[ "${#POINT[@]}" -ge 2 ] || megaloop_die "$ARGS_FILE: expected the config, the run directory, then overrides"

megaloop_setup
RUN_DIR="${POINT[1]}"
mkdir -p "$RUN_DIR"
rm -f "$RUN_DIR/screen_exit"
megaloop_log "LR screen point ${SLURM_ARRAY_TASK_ID}: ${POINT[2]:-} -> $RUN_DIR"
rc=0
megaloop_train "${POINT[0]}" "$RUN_DIR" "${POINT[@]:2}" || rc=$?
echo "$rc" >"$RUN_DIR/screen_exit"
exit "$rc"
