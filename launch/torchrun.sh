#!/usr/bin/env bash
# Single-node multi-process training: NPROC processes (GPUs, or gloo ranks on CPU).
#   NPROC=4 bash launch/torchrun.sh --config tiny --run-dir runs/tp2pp2 parallel.tp=2 parallel.pp=2
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/launch/_setup.sh"
cd "$ROOT"
NPROC="${NPROC:-$(python -c 'import torch; print(max(torch.cuda.device_count(), 1))')}"
export CUDA_DEVICE_MAX_CONNECTIONS=1
exec torchrun --standalone --nproc_per_node "$NPROC" -m megaloop.cli train "$@"
