#!/usr/bin/env bash
# Distilled-prefill student (SPEC §10) under DeepSpeed ZeRO on slurm: one torchrun per node (slurm/common.sh
# for the allocation, rendezvous, venv and logs), every process a data-parallel rank of `megaloop distill-prefill`.
#   TEACHER=hf/S OUT=students/S sbatch slurm/distill.sh
#   TEACHER=hf/L OUT=students/L DATA=/data/val.jsonl DS_CONFIG=zero3 \
#     EXTRA_ARGS="--depth 5 --steps 2000 --batch-size 64 --seq-len 512" sbatch --nodes=2 slurm/distill.sh
# Knobs (environment): TEACHER (required: HF folder or megaloop checkpoint) OUT (students/distill)
# DATA (default = embedded corpus; FILE.txt | FILE.jsonl) DS_CONFIG (zero3; zero1 | zero2 | zero3 | a JSON
# file) SAVE_EVERY (200) EXTRA_ARGS (more `megaloop distill-prefill` options, word-split);
# NODES, GPUS_PER_NODE, RDZV, ...: slurm/common.sh.
# Relative paths (TEACHER, OUT, DATA, a DS_CONFIG file, EXTRA_ARGS' --tokenizer) are relative to the
# directory you submit from.
# Re-submitting continues from OUT/checkpoints (--resume when a checkpoint exists).
# Pre-emption / time limit (--signal=B:USR1@120 --requeue below): the batch shell forwards the USR1
# to every rank of `megaloop distill-prefill` (srun, torchrun); each checkpoints into OUT/checkpoints at the
# next step boundary (whatever SAVE_EVERY) and exits 75, rank 0's status reaches the batch shell
# (MEGALOOP_EXIT_STATUS_FILE), the job requeues itself and the next start continues with --resume
# (slurm/common.sh, megaloop_launch).
#SBATCH --job-name=megaloop-distill
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
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

[ "$#" -eq 0 ] || megaloop_die "unknown argument '$1' (settings are environment knobs: EXTRA_ARGS=\"...\" passes options to megaloop distill-prefill)"
[ -n "${TEACHER:-}" ] || megaloop_die "TEACHER is not set (an HF folder or a megaloop checkpoint)"
OUT="${OUT:-students/distill}"
DATA="${DATA:-default}"
if [ "$DATA" != default ]; then
  DATA="$(megaloop_abspath "$DATA")"
fi
megaloop_post_main distill-prefill "$(megaloop_user_file "${DS_CONFIG:-}" zero3)" "${SAVE_EVERY:-200}" \
  --teacher "$(megaloop_abspath "$TEACHER")" --data "$DATA"
