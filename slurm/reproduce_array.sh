#!/usr/bin/env bash
# One arm of a reproduction experiment per array task. Submitted by
# tools/reproduce.py --launcher slurm, which writes $REPRO_ARMS_DIR/arm_<i>.args (i = the arm's
# index in the experiment; line 1: config, line 2: run dir, line 3: arm name, then one dotlist
# override per line) and $REPRO_DIR/plan.json, and runs, with REPRO_DIR and REPRO_ARMS_DIR in the
# environment,
#   sbatch --array=<indices> --export=ALL slurm/reproduce_array.sh
# Each task trains `megaloop train --resume auto` on its own allocation (slurm/common.sh: NODES,
# GPUS_PER_NODE, rendezvous, requeue on SIGUSR1), records the exit status in RUN_DIR/repro_exit
# and, when training finished, evaluates the arm on this (the batch) node:
#   $PYTHON -m megaloop.repro.evaluate --plan $REPRO_DIR/plan.json --arm NAME --run-dir RUN_DIR
# (PYTHON: default `python` of the activated venv; EVAL_THREADS: CPU threads of the evaluation).
#SBATCH --job-name=megaloop-repro
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

[ -n "${REPRO_DIR:-}" ] || megaloop_die "REPRO_DIR is not set: submit through tools/reproduce.py --launcher slurm"
[ -n "${SLURM_ARRAY_TASK_ID:-}" ] || megaloop_die "SLURM_ARRAY_TASK_ID is not set: submit as an array job (sbatch --array=...)"
ARGS_FILE="${REPRO_ARMS_DIR:-$REPRO_DIR/slurm}/arm_${SLURM_ARRAY_TASK_ID}.args"
[ -f "$ARGS_FILE" ] || megaloop_die "no arm file $ARGS_FILE (array index outside the experiment's arms?)"
[ -f "$REPRO_DIR/plan.json" ] || megaloop_die "no $REPRO_DIR/plan.json (written by tools/reproduce.py)"
mapfile -t ARM <"$ARGS_FILE"
[ "${#ARM[@]}" -ge 3 ] || megaloop_die "$ARGS_FILE: expected the config, the run directory, the arm name, then overrides"

megaloop_setup
RUN_DIR="${ARM[1]}"
ARM_NAME="${ARM[2]}"
mkdir -p "$RUN_DIR"
rm -f "$RUN_DIR/repro_exit"
megaloop_log "experiment arm ${SLURM_ARRAY_TASK_ID} ($ARM_NAME) -> $RUN_DIR"
rc=0
megaloop_train "${ARM[0]}" "$RUN_DIR" "${ARM[@]:3}" || rc=$?
echo "$rc" >"$RUN_DIR/repro_exit"
if [ "$rc" -ne 0 ]; then
  exit "$rc"
fi
eval_args=(-m megaloop.repro.evaluate --plan "$REPRO_DIR/plan.json" --arm "$ARM_NAME" --run-dir "$RUN_DIR")
if [ -n "${EVAL_THREADS:-}" ]; then
  eval_args+=(--threads "$EVAL_THREADS")
fi
megaloop_log "evaluating $ARM_NAME: ${PYTHON:-python} ${eval_args[*]}"
"${PYTHON:-python}" "${eval_args[@]}"
