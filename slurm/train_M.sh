#!/usr/bin/env bash
# Scale M (d=1536; global batch 512 x 2,048 tokens, 40k steps): megaloop pretraining on slurm, one torchrun per node (slurm/common.sh).
#   sbatch slurm/train_M.sh                                   # 2 node(s) x 8 GPUs, embedded corpus (smoke)
#   DATA_PATH=/lustre/txt360/mds VAL_PATH=/lustre/txt360/eval/val TP=2 \
#     sbatch --nodes=4 --partition=gpu slurm/train_M.sh
# Knobs (environment, `${VAR:-default}`): NODES (default: the allocation) GPUS_PER_NODE (8) TP (1)
# PP (1) VPP (unset) DATA_PATH (default = embedded corpus) VAL_PATH (unset; default:val with the
# embedded corpus) RUN_DIR (runs/M) WANDB_MODE (offline) WANDB_PROJECT (megaloop) WANDB_NAME
# EXTRA_ARGS (more dotlist overrides, word-split) CONFIG (M); rendezvous, logs, venv: slurm/common.sh.
# Only the knobs you set are passed: otherwise the config decides (a CONFIG file's parallel.*, data.*,
# logging.*; the defaults above are the preset's), and default:val / offline are added only where neither
# the config nor EXTRA_ARGS sets data.val_path / logging.wandb (default:val: when training on the embedded corpus).
# Submit from anywhere (sbatch /path/to/repo/slurm/THIS.sh; MEGALOOP_ROOT=/path/to/repo overrides): relative paths
# (DATA_PATH, VAL_PATH, RUN_DIR, LOG_DIR, CONFIG/PLAN_CLUSTER files, the data.path, data.val_path,
# data.cache_dir, train.init_weights overrides in EXTRA_ARGS) are relative to the directory you submit
# from, as is slurm-*.out. Re-submitting resumes (--resume auto).
# Preflight: the predicted memory per GPU (megaloop plan) must fit and megaloop must accept the
# configuration, or the job exits 2 (one line) before srun; PLAN_CLUSTER=h100|h200|b200|PATH
# (default: this node's GPU); `--no-preflight` skips it.
#SBATCH --job-name=megaloop-M
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=48:00:00
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail

# The repository: MEGALOOP_ROOT, else this file's (run in place), else the script sbatch was given (slurm runs
# a copy in its spool; `scontrol show job` names the original), else the submission directory.
if [ -n "${MEGALOOP_ROOT:-}" ]; then  # named: it must be the repository (not silently another checkout)
  [ -f "$MEGALOOP_ROOT/slurm/common.sh" ] || { echo "megaloop-slurm: error: MEGALOOP_ROOT=$MEGALOOP_ROOT holds no slurm/common.sh: not a megaloop repository" >&2; exit 2; }
  ROOT="$MEGALOOP_ROOT"
else
  for ROOT in "$(dirname "${BASH_SOURCE[0]}")/.." ""; do [ -f "$ROOT/slurm/common.sh" ] && break; done
fi
if [ -z "$ROOT" ]; then
  # Command= is the script and its arguments, unquoted: words come off the end until it names a file (a space
  # in the path stays)
  JOB_SCRIPT="$(scontrol show job "${SLURM_JOB_ID:-none}" 2>/dev/null | sed -n 's/^ *Command=//p' | head -n 1)" || true
  [[ -z "$JOB_SCRIPT" || "$JOB_SCRIPT" == /* ]] || JOB_SCRIPT="${SLURM_SUBMIT_DIR:-.}/$JOB_SCRIPT"
  while [[ ! -f "$JOB_SCRIPT" && "$JOB_SCRIPT" == *" "* ]]; do JOB_SCRIPT="${JOB_SCRIPT% *}"; done
  for ROOT in "${JOB_SCRIPT:+$(dirname "$JOB_SCRIPT")/..}" "${SLURM_SUBMIT_DIR:-}" ""; do [ -f "$ROOT/slurm/common.sh" ] && break; done
fi
[ -n "$ROOT" ] || { echo "megaloop-slurm: error: repository not found (no slurm/common.sh beside the submitted script or in the submission directory): set MEGALOOP_ROOT" >&2; exit 2; }
ROOT="$(cd "$ROOT" && pwd)"
# shellcheck source=slurm/common.sh
source "$ROOT/slurm/common.sh"

megaloop_scale_main M "$@"
