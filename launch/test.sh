#!/usr/bin/env bash
# Test suite: same install as the quickstart, then pytest (distributed tests launch torchrun over
# gloo with up to 4 processes). Extra arguments go to pytest (e.g. -k tp -x).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/launch/_setup.sh"
cd "$ROOT"
export WANDB_MODE=offline
export MEGALOOP_CACHE="${MEGALOOP_CACHE:-$ROOT/.cache/megaloop}"
python -m pytest tests -q --timeout 900 "$@"
