#!/usr/bin/env bash
# One run of a sweep (megaloop/sweep.py: LR-screen points, reproduction arms) per array task.
# `megaloop lr-screen|reproduce --launcher slurm` writes $SWEEP_TASKS/task_<i>.args (i = the run's
# index in the sweep; line 1: config, line 2: run dir, then one dotlist override per line) and, for
# a run with a follow-up, task_<i>.after (a `megaloop` verb's arguments, one per line, e.g.
# `reproduce --evaluate-arm ARM --out OUT`), then runs, with SWEEP_DIR, SWEEP_TASKS and
# SWEEP_EXIT_FILE in the environment,
#   sbatch --array=<indices> --export=ALL slurm/sweep_array.sh
# Each task trains `megaloop train --resume auto` on its own allocation (slurm/common.sh: NODES,
# GPUS_PER_NODE, rendezvous, requeue on SIGUSR1), records the exit status in
# RUN_DIR/$SWEEP_EXIT_FILE and, when the training exited 0, runs the follow-up on this (the batch)
# node: $PYTHON -m megaloop.cli <after...> (PYTHON: default `python` of the activated venv).
# SWEEP_TASK_FILE, when set, is the task file instead of $SWEEP_TASKS/task_<i>.args. The task runs in
# the repository, but relative paths (SWEEP_*, the config file, the run directory, data.path,
# data.val_path, data.cache_dir, train.init_weights overrides) are relative to where it started (megaloop
# submits with --chdir=the directory it was run from; slurm/common.sh). Per-task logs: LOG_DIR (default
# $SWEEP_DIR/slurm/logs, beside the array's slurm output).
#SBATCH --job-name=megaloop-sweep
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
set -euo pipefail

# The repository: MEGALOOP_ROOT, else this file's (run in place), else the script sbatch was given (slurm runs
# a copy in its spool; `scontrol show job` names the original), else the submission directory.
if [ -n "${MEGALOOP_ROOT:-}" ]; then  # named: it must be the repository (not silently another checkout)
  [ -f "$MEGALOOP_ROOT/slurm/common.sh" ] || { echo "megaloop-slurm: error: MEGALOOP_ROOT=$MEGALOOP_ROOT holds no slurm/common.sh: not a megaloop repository" >&2; exit 2; }
  ROOT="$MEGALOOP_ROOT"
else
  for ROOT in "$(dirname "${BASH_SOURCE[0]}")/.." ""; do [ -f "$ROOT/slurm/common.sh" ] && break; done
fi
if [ -z "$ROOT" ]; then
  # Command= is the script and its arguments, unquoted: words come off the end until it names a file (a space
  # in the path stays)
  JOB_SCRIPT="$(scontrol show job "${SLURM_JOB_ID:-none}" 2>/dev/null | sed -n 's/^ *Command=//p' | head -n 1)" || true
  [[ -z "$JOB_SCRIPT" || "$JOB_SCRIPT" == /* ]] || JOB_SCRIPT="${SLURM_SUBMIT_DIR:-.}/$JOB_SCRIPT"
  while [[ ! -f "$JOB_SCRIPT" && "$JOB_SCRIPT" == *" "* ]]; do JOB_SCRIPT="${JOB_SCRIPT% *}"; done
  for ROOT in "${JOB_SCRIPT:+$(dirname "$JOB_SCRIPT")/..}" "${SLURM_SUBMIT_DIR:-}" ""; do [ -f "$ROOT/slurm/common.sh" ] && break; done
fi
[ -n "$ROOT" ] || { echo "megaloop-slurm: error: repository not found (no slurm/common.sh beside the submitted script or in the submission directory): set MEGALOOP_ROOT" >&2; exit 2; }
ROOT="$(cd "$ROOT" && pwd)"
# shellcheck source=slurm/common.sh
source "$ROOT/slurm/common.sh"

[ -n "${SWEEP_DIR:-}" ] || megaloop_die "SWEEP_DIR is not set: submit through megaloop lr-screen / reproduce --launcher slurm"
[ -n "${SLURM_ARRAY_TASK_ID:-}" ] || megaloop_die "SLURM_ARRAY_TASK_ID is not set: submit as an array job (sbatch --array=...)"
SWEEP_DIR="$(megaloop_abspath "$SWEEP_DIR")"
TASK_FILE="$(megaloop_abspath "${SWEEP_TASK_FILE:-${SWEEP_TASKS:-$SWEEP_DIR/slurm}/task_${SLURM_ARRAY_TASK_ID}.args}")"
[ -f "$TASK_FILE" ] || megaloop_die "no task file $TASK_FILE (array index outside the sweep?)"
mapfile -t TASK <"$TASK_FILE"
[ "${#TASK[@]}" -ge 2 ] || megaloop_die "$TASK_FILE: expected the config, the run directory, then overrides"

LOG_DIR="${LOG_DIR:-$SWEEP_DIR/slurm/logs}"
megaloop_setup
RUN_DIR="$(megaloop_abspath "${TASK[1]}")"
OVERRIDES=()
for ov in "${TASK[@]:2}"; do
  OVERRIDES+=("$(megaloop_abspath_override "$ov")")
done
EXIT_FILE="$RUN_DIR/${SWEEP_EXIT_FILE:-sweep_exit}"
mkdir -p "$RUN_DIR"
rm -f "$EXIT_FILE"
megaloop_log "sweep task ${SLURM_ARRAY_TASK_ID}: ${TASK[2]:-} -> $RUN_DIR"
rc=0
megaloop_train "$(megaloop_abspath_file "${TASK[0]}")" "$RUN_DIR" "${OVERRIDES[@]}" || rc=$?
echo "$rc" >"$EXIT_FILE.tmp"
mv -f "$EXIT_FILE.tmp" "$EXIT_FILE"
AFTER_FILE="${TASK_FILE%.args}.after"
if [ "$rc" -ne 0 ] || [ ! -f "$AFTER_FILE" ]; then
  exit "$rc"
fi
mapfile -t AFTER <"$AFTER_FILE"
megaloop_log "then: ${PYTHON:-python} -m megaloop.cli ${AFTER[*]}"
"${PYTHON:-python}" -m megaloop.cli "${AFTER[@]}"
