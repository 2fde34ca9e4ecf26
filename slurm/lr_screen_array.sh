#!/usr/bin/env bash
# Kept for its name: an LR-screen point as a task of slurm/sweep_array.sh, from the former
# variables (SCREEN_DIR, SCREEN_POINTS_DIR, point_<i>.args; exit status in RUN_DIR/screen_exit).
set -euo pipefail
_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
[ -f "$_dir/sweep_array.sh" ] || _dir="${MEGALOOP_ROOT:-${SLURM_SUBMIT_DIR:-.}}/slurm"
export SWEEP_DIR="${SCREEN_DIR:-}" SWEEP_EXIT_FILE=screen_exit
export SWEEP_TASK_FILE="${SCREEN_POINTS_DIR:-${SCREEN_DIR:-}/slurm}/point_${SLURM_ARRAY_TASK_ID:-}.args"
exec bash "$_dir/sweep_array.sh"
