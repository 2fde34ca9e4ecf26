#!/usr/bin/env bash
# Test suite: same install as the quickstart, then pytest (distributed tests launch torchrun over
# gloo with up to 4 processes). Extra arguments go to pytest (e.g. -k tp -x, or test paths: tests/data -x).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/launch/_setup.sh"
cd "$ROOT"
export WANDB_MODE=offline
# A second interpreter with transformers 5.x and no megaloop: the HF export must load and generate
# there too (tests/hf/test_hf_transformers5.py). Set MEGALOOP_TF5_PYTHON to use another one.
if [ -z "${MEGALOOP_TF5_PYTHON:-}" ]; then
  TF5_VENV="${MEGALOOP_TF5_VENV:-$ROOT/.venv-tf5}"
  TF5_PINS="torch==2.13.0 transformers==5.24.0 tokenizers==0.23.3 safetensors==0.8.0"
  if [ ! -f "$TF5_VENV/.megaloop-stamp" ] || [ "$(cat "$TF5_VENV/.megaloop-stamp")" != "$TF5_PINS" ]; then
    echo "[megaloop] creating $TF5_VENV (transformers 5, for the HF export test)"
    "$PY" -m venv "$TF5_VENV"
    # shellcheck disable=SC2086  # the pins are separate words
    if ! "$TF5_VENV/bin/python" -m pip install -q --disable-pip-version-check $TF5_PINS \
        >"$TF5_VENV/.install.log" 2>&1; then
      tail -20 "$TF5_VENV/.install.log" >&2
      echo "[megaloop] pip install into $TF5_VENV failed" >&2
      exit 1
    fi
    echo "$TF5_PINS" > "$TF5_VENV/.megaloop-stamp"
  fi
  export MEGALOOP_TF5_PYTHON="$TF5_VENV/bin/python"
fi
export MEGALOOP_CACHE="${MEGALOOP_CACHE:-$ROOT/.cache/megaloop}"
# the whole suite, unless the arguments name test paths (bash launch/test.sh tests/data -x)
TARGETS=(tests)
for a in "$@"; do
  if [[ "$a" != -* && -e "${a%%::*}" ]]; then TARGETS=(); break; fi
done
# test files run in parallel (pytest-xdist), each file on one worker (its module fixtures built once):
# one worker per CPU core, at most 4 (a distributed test starts up to 4 processes of its own);
# MEGALOOP_TEST_WORKERS=N sets the count, 0 runs everything in this process
CORES="$(nproc 2>/dev/null || echo 1)"
WORKERS="${MEGALOOP_TEST_WORKERS:-$((CORES < 4 ? CORES : 4))}"
python -m pytest "${TARGETS[@]}" -q --timeout 900 --durations=25 -n "$WORKERS" --dist loadfile "$@"
