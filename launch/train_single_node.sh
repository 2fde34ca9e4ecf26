#!/usr/bin/env bash
# One machine, no slurm: the same knobs as slurm/train_*.sh, torchrun --standalone over NPROC
# processes (GPUs, or gloo ranks on CPU), always resuming from RUN_DIR's latest checkpoint.
#   CONFIG=S DATA_PATH=/data/txt360_mds VAL_PATH=/data/eval/val bash launch/train_single_node.sh
#   CONFIG=tiny NPROC=2 TP=2 bash launch/train_single_node.sh train.max_steps=40
# Knobs: CONFIG (tiny) RUN_DIR (runs/$CONFIG) NPROC (GPU count, else 1) TP PP VPP DATA_PATH VAL_PATH
# WANDB_MODE (offline) WANDB_PROJECT; extra arguments are dotlist overrides. Only the knobs you set are
# passed (a CONFIG file's own settings stand otherwise; offline only where nothing sets logging.wandb).
# SHUTDOWN_TIMEOUT (110: seconds torchrun waits for the workers' checkpoint after a signal).
# Paths (RUN_DIR, DATA_PATH, VAL_PATH, overrides) are relative to the current directory.
# SIGTERM/SIGUSR1/SIGHUP/Ctrl-C make every rank checkpoint after its current step and stop, and the
# script exits with the trainer's status (75, 130 for Ctrl-C; launch/_local_run.sh); run the same
# command again to continue from there.
# Preflight: `megaloop plan --preflight` predicts the memory per GPU of the layout and the launch
# exits 2 (one line) if it does not fit or megaloop refuses the configuration (a bad override or
# layout); PLAN_CLUSTER=h100|h200|b200|PATH (default: this machine's GPU, skipped without one);
# --no-preflight (anywhere among the arguments) or PREFLIGHT=0 skips it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=launch/_setup.sh
source "$ROOT/launch/_setup.sh"
# shellcheck source=slurm/common.sh
source "$ROOT/slurm/common.sh"  # megaloop_preflight
# shellcheck source=launch/_local_run.sh
source "$ROOT/launch/_local_run.sh"

PREFLIGHT="${PREFLIGHT:-1}"
ARGS=()
for a in "$@"; do
  if [ "$a" = --no-preflight ]; then PREFLIGHT=0; else ARGS+=("$a"); fi
done

CONFIG_GIVEN=0
[ -z "${CONFIG:-}" ] || CONFIG_GIVEN=1
CONFIG="${CONFIG:-tiny}"
RUN_DIR="${RUN_DIR:-runs/$CONFIG}"
if [ "$CONFIG_GIVEN" = 0 ] && [ -e "$CONFIG" ]; then
  # the default preset, not a file or directory of that name here (megaloop would take that)
  CONFIG="$ROOT/megaloop/configs/$CONFIG.yaml"
fi
NPROC="${NPROC:-$(python -c 'import torch; print(max(torch.cuda.device_count(), 1))')}"
TP="${TP:-}"
PP="${PP:-}"
VPP="${VPP:-}"
DATA_PATH="${DATA_PATH:-}"
VAL_PATH="${VAL_PATH:-}"
WANDB_MODE="${WANDB_MODE:-}"
WANDB_PROJECT="${WANDB_PROJECT:-}"
export CUDA_DEVICE_MAX_CONNECTIONS=1

# Only the knobs that are set: otherwise the config decides (a CONFIG file's parallel.*, data.*, logging.*;
# megaloop's defaults TP 1, PP 1, project megaloop); logging.wandb=offline fills in where neither the
# config nor an argument sets logging.wandb.
OVERRIDES=()
if [ -n "$TP" ]; then OVERRIDES+=("parallel.tp=$TP"); fi
if [ -n "$PP" ]; then OVERRIDES+=("parallel.pp=$PP"); fi
if [ -n "$VPP" ]; then OVERRIDES+=("parallel.vpp=$VPP"); fi
if [ -n "$DATA_PATH" ]; then OVERRIDES+=("data.path=$DATA_PATH"); fi
if [ -n "$VAL_PATH" ]; then OVERRIDES+=("data.val_path=$VAL_PATH"); fi
if [ -z "$WANDB_MODE" ]; then
  megaloop_config_facts "$CONFIG" "$CONFIG_GIVEN"
  for a in "${ARGS[@]}"; do
    case "$a" in logging.wandb=*) MEGALOOP_CFG_WANDB=1 ;; esac
  done
  [ "$MEGALOOP_CFG_WANDB" = 1 ] || WANDB_MODE=offline
fi
if [ -n "$WANDB_MODE" ]; then
  export WANDB_MODE
  OVERRIDES+=("logging.wandb=$WANDB_MODE")
fi
if [ -n "$WANDB_PROJECT" ]; then
  export WANDB_PROJECT
  OVERRIDES+=("logging.project=$WANDB_PROJECT")
fi

if [ "$PREFLIGHT" != 0 ]; then
  megaloop_preflight "$CONFIG" "$NPROC" "$NPROC" "${OVERRIDES[@]}" "${ARGS[@]}"
fi

# Signals reach torchrun through this shell, which passes them to the workers (checkpoint, exit 75).
rc=0
megaloop_local_run torchrun --standalone --nproc_per_node "$NPROC" \
  --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout "${SHUTDOWN_TIMEOUT:-110}" \
  -m megaloop.cli train --config "$CONFIG" --run-dir "$RUN_DIR" --resume auto "${OVERRIDES[@]}" "${ARGS[@]}" || rc=$?
exit "$rc"
