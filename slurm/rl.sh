#!/usr/bin/env bash
# GRPO with endpoint reuse (SPEC §9) under DeepSpeed ZeRO on slurm: one torchrun per node (slurm/common.sh
# for the allocation, rendezvous, venv and logs), every process a data-parallel rank of `megaloop rl`.
#   MODEL=hf/S OUT=hf/S-rl sbatch slurm/rl.sh
#   MODEL=runs/M/checkpoints OUT=hf/M-rl TASK=gsm8k:/data/gsm8k.jsonl DS_CONFIG=zero1 \
#     EXTRA_ARGS="--arm reuse --steps 500 --prompts 64 --group-size 8" sbatch --nodes=2 slurm/rl.sh
# Knobs (environment): MODEL (required: HF folder or megaloop checkpoint) OUT (runs/rl) TASK (arithmetic)
# DS_CONFIG (zero2; zero1 | zero2 | a JSON file; ZeRO-3 is refused by `megaloop rl`) SAVE_EVERY (50)
# EXTRA_ARGS (more `megaloop rl` options, word-split); NODES, GPUS_PER_NODE, RDZV, ...: slurm/common.sh.
# Re-submitting continues from OUT/checkpoints (--resume when a checkpoint exists).
#SBATCH --job-name=megaloop-rl
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail

_here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ROOT=""
for _c in "${MEGALOOP_ROOT:-}" "$_here" "${SLURM_SUBMIT_DIR:-}"; do
  if [ -n "$_c" ] && [ -f "$_c/slurm/common.sh" ]; then ROOT="$(cd "$_c" && pwd)"; break; fi
done
[ -n "$ROOT" ] || { echo "megaloop-slurm: error: repository not found: sbatch from its root or set MEGALOOP_ROOT" >&2; exit 2; }
# shellcheck source=slurm/common.sh
source "$ROOT/slurm/common.sh"

[ -n "${MODEL:-}" ] || megaloop_die "MODEL is not set (an HF folder or a megaloop checkpoint)"
OUT="${OUT:-runs/rl}"
TASK="${TASK:-arithmetic}"
DS_CONFIG="${DS_CONFIG:-zero2}"
SAVE_EVERY="${SAVE_EVERY:-50}"
EXTRA_ARGS="${EXTRA_ARGS:-}"
case "$SAVE_EVERY" in '' | *[!0-9]*) megaloop_die "SAVE_EVERY must be a non-negative integer, got '$SAVE_EVERY'" ;; esac
megaloop_setup

cmd=(-m megaloop.cli rl --model "$MODEL" --out "$OUT" --task "$TASK" --deepspeed "$DS_CONFIG"
  --save-every "$SAVE_EVERY")
if [ -f "$OUT/checkpoints/latest" ]; then
  cmd+=(--resume)
fi
read -r -a extra <<<"$EXTRA_ARGS"
cmd+=("${extra[@]}")

rc=0
megaloop_launch "${cmd[@]}" || rc=$?
exit "$rc"
