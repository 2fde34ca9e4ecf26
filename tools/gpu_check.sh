#!/usr/bin/env bash
# GPU check: one CUDA machine, no network, < 8 minutes on an H200. Uses the CUDA PyTorch already
# installed there plus the wheels shipped in .whl/ (made by tools/gpu/fetch_wheels.sh: megatron-core
# cp312 and what megaloop's training path imports that the image lacks; Transformer Engine is used
# only if the image has it). Writes logs and JSON to $OUT (default gpu_check_out), summary in
# $OUT/summary.json.
#   bash tools/gpu/fetch_wheels.sh      # here, once (needs PyPI); .whl/ must travel with the tree
#   bash tools/gpu_check.sh             # on the GPU machine
#   GPU_CHECK_CPU_SMOKE=1 bash tools/gpu_check.sh   # the same steps on CPU, tiny sizes (~1-2 min)
# Steps: (0) install .whl/, describe the device, import the training path; (1) TP=1 logits on the GPU
# vs the CPU FP32 reference; (2) S-config training throughput, MFU and peak memory in bf16 (and FP8
# when TE imports); (3) the loop-overhead benchmark on the GPU; then the planner's predictions for the
# training runs (plan_calibration.json) and summary.json. A failing step
# does not stop the others (only a failed wheel install, no CUDA device or no usable python at step 0
# do); the script then exits 1 naming it. The CPU smoke mode runs the same scripts with the tiny
# config and small sizes and without the CUDA requirement, and never writes into tools/bench/results/.
# Environment: OUT, STEPS (training steps), PYTHON (default python3), GPU_CHECK_WHL (default .whl),
# GPU_CHECK_SITE (default /tmp/site), GPU_CHECK_RUNS (run dirs with checkpoints, outside $OUT),
# MEGALOOP_CACHE.
set -euo pipefail
cd "$(dirname "$0")/.."
SMOKE="${GPU_CHECK_CPU_SMOKE:-0}"
PY="${PYTHON:-python3}"
WHL="${GPU_CHECK_WHL:-.whl}"
SITE="${GPU_CHECK_SITE:-/tmp/site}"
if [ "$SMOKE" = 1 ]; then
  MODE=cpu_smoke
  OUT="${OUT:-/tmp/gpu_check_smoke}"
  RUNS="${GPU_CHECK_RUNS:-$OUT/runs}"
  CONFIG=tiny STEPS="${STEPS:-4}" WARMUP=1 GBS=8 MBS=4 PREC=fp32
  # train.peak_tflops: a nominal 1 TFLOP/s so the MFU code path runs on CPU too. Training in FP32
  # (the tiny preset's default): bf16 matmuls are ~10x slower on CPU.
  EXTRA_TRAIN=(train.peak_tflops=1.0)
  LOGITS_ARGS=(--hidden 128 --heads 4 --seq 64 --vocab 1024)
  BENCH_ARGS=(--hidden 64 --heads 4 --seq 64 --batch 2 --vocab 512 --reps 2 --bf16)
  T_PROBE=120 T_LOGITS=120 T_TRAIN=150 T_FP8=150 T_BENCH=120
else
  MODE=gpu
  OUT="${OUT:-gpu_check_out}"
  RUNS="${GPU_CHECK_RUNS:-/tmp/gpu_check_runs}"
  CONFIG=S STEPS="${STEPS:-30}" WARMUP=5 GBS=32 MBS=4 PREC=bf16
  EXTRA_TRAIN=()
  LOGITS_ARGS=()
  BENCH_ARGS=(--hidden 1024 --heads 16 --seq 2048 --batch 4 --reps 10 --bf16)
  # worst case 60+80+150+110+80 s = 8 min; expected well under half of that
  T_PROBE=60 T_LOGITS=80 T_TRAIN=150 T_FP8=110 T_BENCH=80
fi
# $OUT must be new, empty or an earlier check's (its .gpu_check_out mark): the clean-up below deletes
# *.log and train_* there, which in any other folder (OUT=runs, OUT=.) are someone's files
# the same for GPU_CHECK_RUNS, where each training run's folder is removed before it runs again
for dir_var in OUT RUNS; do
  dir="${!dir_var}"
  if [ "$dir_var" = RUNS ] && [ "$dir" = "$OUT/runs" ] && [ -f "$OUT/.gpu_check_out" ]; then
    continue  # the smoke mode's runs inside an earlier check's OUT
  fi
  if [ -d "$dir" ] && [ ! -f "$dir/.gpu_check_out" ] && [ -n "$(ls -A "$dir")" ]; then
    echo "gpu_check: ${dir_var/RUNS/GPU_CHECK_RUNS}=$dir holds files that are not a gpu_check's output; give a new or empty folder" >&2
    exit 2
  fi
done
mkdir -p "$OUT" "$RUNS"
OUT="$(cd "$OUT" && pwd)"
RUNS="$(cd "$RUNS" && pwd)"
touch "$OUT/.gpu_check_out" "$RUNS/.gpu_check_out"
# outputs of an earlier run must not stand in for this one's
rm -rf "$OUT"/steps.tsv "$OUT"/summary.json "$OUT"/device.json "$OUT"/logits.json "$OUT"/loop_overhead*.json \
  "$OUT"/train_* "$OUT"/*.log "$OUT"/plan_calibration.json

if [ -d "$WHL" ] && compgen -G "$WHL/*.whl" >/dev/null; then
  echo "== 0. installing $(find "$WHL" -maxdepth 1 -name '*.whl' | wc -l) wheels from $WHL into $SITE"
  if "$PY" -m pip --version >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHL"/*.whl \
      || { echo "gpu_check: FAILED: pip could not install the wheels in $WHL into $SITE" >&2; exit 1; }
  else  # no pip in the image: a wheel is a zip of its import tree (none of these has a .data/ part)
    echo "gpu_check: $PY has no pip; unpacking the wheels into $SITE"
    "$PY" -c "import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]" \
      "$SITE" "$WHL"/*.whl || { echo "gpu_check: FAILED: could not unpack $WHL/*.whl" >&2; exit 1; }
  fi
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "== 0. no wheels in $WHL: using the installed packages"
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_MODE=disabled PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
export MEGALOOP_CACHE="${MEGALOOP_CACHE:-/tmp/megaloop-cache}"

FAILED=()
# run_step NAME LIMIT_S COMMAND...: output to the console and $OUT/NAME.log; records exit code and
# seconds in $OUT/steps.tsv; a failure is reported and remembered, the script goes on.
run_step() {
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  echo "== $name (limit ${limit}s)"
  set +e
  timeout -k 20 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  rc=${PIPESTATUS[0]}
  set -e
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" >>"$OUT/steps.tsv"
  if [ "$rc" -ne 0 ]; then
    local why="exit $rc"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then why="timed out after ${limit}s"; fi
    echo "gpu_check: step '$name' FAILED ($why); last lines of $OUT/$name.log:" >&2
    tail -n 30 "$OUT/$name.log" >&2
    FAILED+=("$name")
  fi
}

summarize() {
  "$PY" tools/gpu/summarize.py "$OUT" --mode "$MODE" --warmup "$WARMUP" --config "$CONFIG" "$@"
}

PROBE_ARGS=()
[ "$SMOKE" = 1 ] && PROBE_ARGS=(--cpu-smoke)
run_step probe "$T_PROBE" "$PY" tools/gpu/probe.py "$OUT/device.json" "${PROBE_ARGS[@]}"
abort() {
  summarize >/dev/null 2>&1 || true
  echo "gpu_check: FAILED: $*; nothing else was run (see $OUT/probe.log)" >&2
  exit 1
}
[ -s "$OUT/device.json" ] || abort "the probe could not run with $PY"
if [ "$SMOKE" != 1 ] && ! grep -q '"cuda_available": true' "$OUT/device.json"; then
  abort "no CUDA device"
fi
# A failed import (probe.log names it) does not stop the steps: each reports its own traceback.

run_step logits "$T_LOGITS" "$PY" tools/gpu/logits_check.py --out "$OUT/logits.json" "${LOGITS_ARGS[@]}"

# train_run NAME LIMIT_S [OVERRIDES...]: one training run; its run dir (with the final checkpoint)
# stays in $RUNS, metrics.jsonl and config.yaml are copied to $OUT/train_NAME/. data.num_workers=0:
# the embedded corpus holds only ~60 sequences of 2048 tokens, so the loader starts a new epoch
# every ~2 steps and would fork new worker processes each time (and workers need /dev/shm space).
train_run() {
  local name=$1 limit=$2
  shift 2
  rm -rf "${RUNS:?}/$name"
  mkdir -p "$OUT/train_$name"
  run_step "train_$name" "$limit" "$PY" -m megaloop.cli train --config "$CONFIG" --run-dir "$RUNS/$name" \
    train.max_steps=20000 train.stop_after="$STEPS" train.save_interval=0 train.eval_interval=0 \
    train.eval_batches=1 train.log_interval=1 train.global_batch_size="$GBS" train.micro_batch_size="$MBS" \
    logging.progress=false logging.wandb=disabled data.num_workers=0 "${EXTRA_TRAIN[@]}" "$@"
  cp "$RUNS/$name/metrics.jsonl" "$RUNS/$name/config.yaml" "$OUT/train_$name/" 2>/dev/null || true
}

RUNS_EXPECTED=("$PREC")
train_run "$PREC" "$T_TRAIN"  # the S preset is bf16, the smoke mode's tiny preset FP32
if "$PY" -c "import json, sys; sys.exit(not json.load(open(sys.argv[1])).get('transformer_engine'))" \
    "$OUT/device.json" 2>/dev/null; then  # the probe asked the trainer's own TE check
  RUNS_EXPECTED+=(fp8)
  train_run fp8 "$T_FP8" model.fp8=hybrid
else
  echo "== train_fp8 skipped: the trainer would not use Transformer Engine here (see device.json)"
fi

# the result goes to $OUT (only $OUT comes back from the GPU machine; never over the committed CPU file)
run_step loop_overhead "$T_BENCH" env MEGALOOP_BENCH_RESULTS="$OUT" "$PY" tools/bench/bench_loop_overhead.py \
  "${BENCH_ARGS[@]}"

# What the planner's assumed GPU constants need (megaloop/plan): its predictions for the training runs
# above beside their measured step time and peak memory, in $OUT/plan_calibration.json (and summary.json).
# Not a step of the check: a failure only leaves the file out.
"$PY" tools/gpu/plan_calibration.py "$OUT" --runs "${RUNS_EXPECTED[@]}" --warmup "$WARMUP" \
  >"$OUT/plan_calibration.log" 2>&1 || echo "gpu_check: plan calibration failed (see $OUT/plan_calibration.log)" >&2

set +e
summarize --runs "${RUNS_EXPECTED[@]}"
SUMMARY_RC=$?
set -e
if [ "$MODE" = gpu ] && [ -f "$OUT/summary.json" ]; then
  cp "$OUT/summary.json" tools/bench/results/gpu_check.json
  cp "$OUT"/loop_overhead_gpu.json tools/bench/results/ 2>/dev/null || true
fi
if [ ${#FAILED[@]} -gt 0 ] || [ "$SUMMARY_RC" -ne 0 ]; then
  echo "gpu_check: FAILED (${MODE}): ${FAILED[*]:-summary checks}; logs and summary.json in $OUT" >&2
  exit 1
fi
echo "gpu_check: OK (${MODE}); summary in $OUT/summary.json"
