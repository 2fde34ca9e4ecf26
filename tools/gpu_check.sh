#!/usr/bin/env bash
# GPU check: one CUDA machine, no network, < 8 minutes on an H200. Uses the CUDA PyTorch already
# installed there plus wheels shipped in .whl/ (megatron-core cp312 and what megaloop needs that
# the image lacks; Transformer Engine optional). Writes JSON/logs to $OUT (default gpu_check_out).
#   bash tools/gpu_check.sh
# Steps: (1) TP=1 logits on the GPU vs the CPU FP32 reference; (2) S-config training throughput,
# MFU and peak memory in bf16 (and FP8 when TE imports); (3) the loop-overhead benchmark on GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_check_out}"
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_MODE=disabled PYTHONUNBUFFERED=1
export MEGALOOP_CACHE="${MEGALOOP_CACHE:-/tmp/megaloop-cache}"
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"

echo "== 1. logits: GPU vs CPU reference"
timeout 120 python3 tools/gpu/logits_check.py | tee "$OUT/logits.json"

echo "== 2. training throughput (S, bf16)"
STEPS="${STEPS:-30}"
timeout 240 python3 -m megaloop.cli train --config S --run-dir "$OUT/S_bf16" \
  train.max_steps=20000 train.stop_after="$STEPS" train.save_interval=0 train.eval_interval=0 \
  train.eval_batches=1 train.global_batch_size=32 train.micro_batch_size=4 logging.progress=false \
  | tee "$OUT/S_bf16.log"
if python3 -c "import transformer_engine" 2>/dev/null; then
  echo "== 2b. training throughput (S, FP8 via Transformer Engine)"
  timeout 240 python3 -m megaloop.cli train --config S --run-dir "$OUT/S_fp8" model.fp8=hybrid \
    train.max_steps=20000 train.stop_after="$STEPS" train.save_interval=0 train.eval_batches=1 \
    train.global_batch_size=32 train.micro_batch_size=4 logging.progress=false | tee "$OUT/S_fp8.log"
fi
python3 - "$OUT" <<'PY'
import json, statistics, sys, pathlib
out = pathlib.Path(sys.argv[1])
for run in sorted(out.glob("S_*/metrics.jsonl")):
    rows = [json.loads(l) for l in run.read_text().splitlines()][5:]
    if rows:
        keys = ("tokens_per_s", "tflops", "mfu", "step_time_s", "peak_mem_gib")
        print(run.parent.name, {k: round(statistics.median(r[k] for r in rows if k in r), 4) for k in keys if k in rows[0]})
PY

echo "== 3. loop overhead on the GPU"
timeout 180 python3 tools/bench/bench_loop_overhead.py --hidden 1024 --heads 16 --seq 2048 --batch 4 --reps 10 --bf16
cp tools/bench/results/loop_overhead_gpu.json "$OUT/" 2>/dev/null || true
