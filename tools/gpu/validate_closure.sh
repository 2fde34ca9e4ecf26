#!/usr/bin/env bash
# Check, without a GPU, that the wheel set of tools/gpu/fetch_wheels.sh is enough: a throwaway
# Python 3.11 venv with roughly the GPU image's packages (no megatron-core, streaming, wandb,
# pydantic, zstd, snappy, ...), the same wheels fetched for cp311 and installed with gpu_check.sh's
# own `pip install --no-index --no-deps --target` line, the repo *not* pip-installed (PYTHONPATH
# only, as on the GPU machine), then gpu_check.sh's CPU smoke mode. Needs PyPI; ~1-2 GB in /tmp.
#   bash tools/gpu/validate_closure.sh [VENV_DIR]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${1:-/tmp/gpuimg311}"
WORK="${VALIDATE_WORK:-/tmp/gpu_closure_check}"
PY311="${PY311:-python3.11}"

if [ ! -x "$VENV/bin/python" ]; then
  "$PY311" -m venv "$VENV"
  # torch: the project's pinned CPU wheel (the image has CUDA torch 2.11)
  "$VENV/bin/python" -m pip install -q torch==2.13.0
  # the image's other packages at the image's versions where they exist for Python 3.11
  # (numpy 2.5 needs Python >= 3.12: the newest 2.4 stands in)
  "$VENV/bin/python" -m pip install -q transformers==5.17.0 tokenizers==0.23.2 huggingface_hub==1.33.0 \
    "numpy==2.4.*" safetensors==0.8.0 accelerate click einops filelock fsspec jinja2 matplotlib networkx \
    packaging pillow protobuf psutil pyyaml regex requests rich sentencepiece sympy tqdm xxhash \
    typing-extensions certifi idna urllib3 charset-normalizer pytest
  # not in the image (pulled in by typer here)
  "$VENV/bin/python" -m pip uninstall -y -q pydantic pydantic_core || true
fi
for mod in megatron streaming wandb pydantic zstd snappy brotli catalogue deepspeed transformer_engine megaloop; do
  if (cd / && env -u PYTHONPATH "$VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(0 if u.find_spec('$mod') is None else 1)"); then
    :
  else
    echo "validate_closure: $VENV already has '$mod'; it must not (the GPU image lacks it)" >&2
    exit 1
  fi
done

rm -rf "$WORK"
mkdir -p "$WORK"
PYVER=3.11 PYTHON="$VENV/bin/python" bash "$ROOT/tools/gpu/fetch_wheels.sh" "$WORK/whl"
env -u PYTHONPATH GPU_CHECK_CPU_SMOKE=1 PYTHON="$VENV/bin/python" GPU_CHECK_WHL="$WORK/whl" \
  GPU_CHECK_SITE="$WORK/site" OUT="$WORK/out" MEGALOOP_CACHE="$WORK/cache" bash "$ROOT/tools/gpu_check.sh"
echo "validate_closure: OK: the wheel set runs every gpu_check step in an image-like environment"
