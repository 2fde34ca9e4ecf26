#!/usr/bin/env bash
# Single-node multi-process training: NPROC processes (GPUs, or gloo ranks on CPU).
#   NPROC=4 bash launch/torchrun.sh --config tiny --run-dir runs/tp2pp2 parallel.tp=2 parallel.pp=2
# Paths in the arguments are relative to the current directory. Exits with the trainer's status
# (75 after a signal-triggered checkpoint; see launch/_local_run.sh).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=launch/_setup.sh
source "$ROOT/launch/_setup.sh"
# shellcheck source=launch/_local_run.sh
source "$ROOT/launch/_local_run.sh"
NPROC="${NPROC:-$(python -c 'import torch; print(max(torch.cuda.device_count(), 1))')}"
export CUDA_DEVICE_MAX_CONNECTIONS=1
rc=0
megaloop_local_run torchrun --standalone --nproc_per_node "$NPROC" \
  --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout "${SHUTDOWN_TIMEOUT:-110}" \
  -m megaloop.cli train "$@" || rc=$?
exit "$rc"
