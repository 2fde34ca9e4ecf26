#!/usr/bin/env bash
# Download the wheels that tools/gpu_check.sh installs on the lent GPU machine (no network there).
#   bash tools/gpu/fetch_wheels.sh            # -> .whl/ at the repo root (git-ignored), cp312
#   PYVER=3.11 bash tools/gpu/fetch_wheels.sh /tmp/whl311   # same set for another CPython
#
# The GPU image (Python 3.12, CUDA torch 2.11, transformers 5.17, tokenizers 0.23, numpy 2.5, ...)
# lacks exactly these import-time dependencies of `python -m megaloop.cli train`,
# tools/bench/bench_loop_overhead.py and tools/gpu/logits_check.py (found by listing sys.modules
# after each run and mapping it to distributions; see tools/gpu/import_closure.py):
#   megatron-core            the model/optimizer/schedules
#   mosaicml-streaming       the data loaders; its package __init__ imports, unconditionally:
#     brotli, python-snappy (+ its backend cramjam), zstd   streaming.base.compression
#     catalogue                                             streaming.base.registry_utils
#   (also xxhash, tqdm, numpy and transformers' BatchFeature/BatchEncoding, which the image has;
#    transformers 5.17 still provides both, and the training path uses no other transformers API)
# Not shipped: wandb (megatron imports it in try/except; logging.wandb defaults to disabled),
# torchvision/datasets (streaming.vision/text/multimodal are deferred by
# megaloop/data/_streaming_compat.py), the cloud SDKs (imported by streaming only when a remote
# URL is used), transformer-engine (FP8 is measured only where the image already has it).
# Versions: megatron-core and mosaicml-streaming as pinned in pyproject.toml /
# launch/constraints.txt; the small ones as in the project's CPU environment. zstd 1.5.7.2's cp312
# wheel is tagged manylinux_2_14 only (found through EXTRA_PLATFORMS; libzstd is linked in);
# 1.5.7.3 and 1.5.6.2 are yanked.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
DEST="${1:-$ROOT/.whl}"
PYVER="${PYVER:-3.12}"
PY="${PYTHON:-python3}"
MAX_MIB="${MAX_MIB:-50}"

WHEELS=(
  megatron-core==0.16.1
  mosaicml-streaming==0.13.0
  catalogue==2.0.10
  brotli==1.2.1
  python-snappy==0.7.3
  cramjam==2.14.0
  zstd==1.5.7.2
)

BASE_PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64
                manylinux1_x86_64)
# Tried only for a package that has none of the above; the image is a glibc >= 2.35 system.
EXTRA_PLATFORMS=(manylinux_2_24_x86_64 manylinux_2_14_x86_64 manylinux_2_4_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64
                 manylinux_2_35_x86_64)

mkdir -p "$DEST"
plat_args() { local p; for p in "$@"; do printf -- '--platform\n%s\n' "$p"; done; }
mapfile -t BASE < <(plat_args "${BASE_PLATFORMS[@]}")
mapfile -t EXTRA < <(plat_args "${EXTRA_PLATFORMS[@]}")

for spec in "${WHEELS[@]}"; do
  if ! "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
      "${BASE[@]}" -d "$DEST" "$spec"; then
    echo "fetch_wheels: $spec has no wheel for ${BASE_PLATFORMS[*]}; trying ${EXTRA_PLATFORMS[*]}" >&2
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
      "${BASE[@]}" "${EXTRA[@]}" -d "$DEST" "$spec" \
      || { echo "fetch_wheels: no cp${PYVER/./} x86-64 wheel of $spec" >&2; exit 1; }
  fi
done

# Keep exactly one wheel per pinned distribution (an earlier run may have left other versions).
"$PY" - "$DEST" "${WHEELS[@]}" <<'PY'
import re
import sys
from pathlib import Path

dest, specs = Path(sys.argv[1]), sys.argv[2:]
norm = lambda s: re.sub(r"[-_.]+", "_", s).lower()  # noqa: E731
want = {norm(s.split("==")[0]): s.split("==")[1] for s in specs}
for whl in sorted(dest.glob("*.whl")):
    name, version = whl.name.split("-")[:2]
    if norm(name) not in want or version != want[norm(name)]:
        print(f"fetch_wheels: removing {whl.name} (not in the pinned set)")
        whl.unlink()
missing = [n for n in want if not any(norm(w.name.split("-")[0]) == n for w in dest.glob("*.whl"))]
if missing:
    sys.exit(f"fetch_wheels: missing wheels for {missing}")
PY

total=0
while IFS= read -r -d '' f; do
  size=$(stat -c %s "$f")
  total=$((total + size))
  awk -v s="$size" -v n="$(basename "$f")" 'BEGIN { printf "%8.2f MiB  %s\n", s / 1048576, n }'
done < <(find "$DEST" -maxdepth 1 -type f -name '*.whl' -print0 | sort -z)
awk -v s="$total" -v d="$DEST" 'BEGIN { printf "%8.2f MiB  total in %s\n", s / 1048576, d }'
if [ "$total" -gt $((MAX_MIB * 1048576)) ]; then
  echo "fetch_wheels: wheels total more than ${MAX_MIB} MiB; the working tree sent to the GPU machine must stay under 64 MiB" >&2
  exit 1
fi
