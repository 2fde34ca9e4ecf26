#!/usr/bin/env bash
# Shared set-up for launch/quickstart.sh and launch/test.sh: create .venv if absent and install
# megaloop with its pinned dependencies (launch/constraints.txt). Idempotent and fast when current.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MEGALOOP_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3

if [ ! -x "$VENV/bin/python" ]; then
  echo "[megaloop] creating virtual environment in $VENV"
  "$PY" -m venv "$VENV"
fi
# Re-install only when the dependency declarations changed (stamp = hash of pyproject + constraints).
STAMP="$VENV/.megaloop-install-stamp"
WANT="$(cat "$ROOT/pyproject.toml" "$ROOT/launch/constraints.txt" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "[megaloop] installing dependencies (first run takes a few minutes)"
  # DeepSpeed must not try to JIT-build its CUDA ops on CPU machines.
  export DS_BUILD_OPS=0
  LOG="$VENV/.megaloop-install.log"
  if ! "$VENV/bin/python" -m pip install -q --disable-pip-version-check \
      -c "$ROOT/launch/constraints.txt" -e "$ROOT[eval,test]" >"$LOG" 2>&1; then
    grep -v "is ignored" "$LOG" | tail -40 >&2
    echo "[megaloop] pip install failed (full log: $LOG)" >&2
    exit 1
  fi
  # mosaicml-streaming pulls PyPI torchvision, whose compiled ops do not load beside CPU torch
  # 2.13.0; megaloop.data installs the tiny import shim streaming needs instead (see README).
  "$VENV/bin/python" -m pip uninstall -y -q torchvision >/dev/null 2>&1 || true
  "$VENV/bin/python" -W ignore -c "import megaloop, megatron.core, megaloop.data, streaming" \
      || { echo "[megaloop] install check failed" >&2; exit 1; }
  echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
export PYTHONUNBUFFERED=1
