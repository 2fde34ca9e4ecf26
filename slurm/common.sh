# shellcheck shell=bash
# Shared by slurm/train_{S,M,L}.sh, slurm/sweep_array.sh, slurm/rl.sh, slurm/distill.sh and
# launch/train_single_node.sh: sourced (after `set -euo pipefail` and with ROOT set to the repository), never run on its own.
#
#   megaloop_setup                         check the allocation, cd to ROOT, activate the venv,
#                                          derive the rendezvous and the per-job log directory
#   megaloop_abspath PATH                  PATH made absolute against MEGALOOP_START_DIR (below)
#   megaloop_launch PYTHON_ARGS...         srun one torchrun per node running PYTHON_ARGS (e.g.
#                                          `-m megaloop.cli rl ...`); signal forwarding, requeue
#                                          and logs as below; returns its exit status
#   megaloop_train CONFIG RUN_DIR [KEY=VALUE ...]
#                                          megaloop_launch `-m megaloop.cli train --config CONFIG
#                                          --run-dir RUN_DIR --resume auto KEY=VALUE ...`
#   megaloop_scale_overrides               TP/PP/VPP/DATA_PATH/VAL_PATH/WANDB_*/EXTRA_ARGS knobs of
#                                          slurm/train_*.sh -> the array OVERRIDES (only the knobs set:
#                                          the config's own settings stand otherwise)
#   megaloop_user_file VALUE DEFAULT       a CONFIG / DS_CONFIG knob: a given VALUE (a file there wins)
#                                          or the built-in DEFAULT as it is
#   megaloop_preflight CONFIG WORLD GPUS_PER_NODE [KEY=VALUE ...]
#                                          `megaloop plan --preflight`: exit 2 (one line) if the layout
#                                          is predicted not to fit in GPU memory or the configuration is
#                                          refused (megaloop's exit 2: bad input, which every rank would
#                                          refuse too); any other failure (no usable python, a planner
#                                          crash) only warns and the launch goes on
#
# Paths: the job runs in ROOT (megaloop_setup cds there), but every path the user gives (DATA_PATH,
# VAL_PATH, RUN_DIR, CONFIG and PLAN_CLUSTER files, LOG_DIR, VENV; OUT, MODEL, TEACHER, DATA, TASK's
# file, DS_CONFIG files of rl.sh/distill.sh; SWEEP_*, the config file and the run directory of a
# sweep task; the path fields data.path, data.val_path, data.cache_dir, train.init_weights among the
# dotlist overrides of EXTRA_ARGS and of a sweep task) is relative to MEGALOOP_START_DIR, the directory
# the batch script started in: where sbatch was run (SLURM_SUBMIT_DIR), or its --chdir (megaloop's
# sweeps submit with --chdir=their caller's directory). They are made absolute before the cd.
#
# Pre-emption / time limit: submit with `--signal=B:USR1@120 --requeue`. The USR1 reaches this
# (batch) shell, which forwards it to srun; srun passes it to every task, torchrun (told to handle
# SIGUSR1) passes it to the workers, and the trainer checkpoints after its current step and exits
# 75. The job then requeues itself (`scontrol requeue`), and the next start resumes from the latest
# checkpoint (`--resume auto` is always passed). A trainer exit status 75 (e.g. a direct SIGTERM to
# a worker) requeues too: torchrun reports any failed worker as 1, so the trainer's own status is
# read from $LOG_DIR/$SLURM_JOB_ID/trainer_exit (written by global rank 0, MEGALOOP_EXIT_STATUS_FILE). After USR1 a run that finished (0) or was refused (2) meanwhile is
# not requeued. A USR1 before the launch (set-up, preflight) requeues without starting it; one after it (a
# follow-up step in this shell) is logged and the step goes on. SIGTERM to this shell alone (`scancel --batch --signal=TERM JOBID`; a plain `scancel
# --signal=TERM` signals only the job steps, whose trainer then exits 75 and the job requeues) is forwarded
# but never requeues, unless a USR1 came first.
# Each node's log then ends with torchrun's `SignalException: Process N got signal: 10` traceback:
# expected. torchrun's agent re-raises the signal it forwarded once its workers have stopped (torch's
# elastic agent `run`); signalling the workers instead of torchrun would trade it for torchrun's
# ChildFailedError traceback on the trainer's exit 75, and lose torchrun's --shutdown-timeout wait.
#
# Knobs (environment, all optional):
#   NODES            nodes to use (default: all of the allocation, $SLURM_NNODES)
#   GPUS_PER_NODE    processes per node, >= 1 (default $SLURM_GPUS_ON_NODE, else 8)
#   RDZV             c10d (default: torchrun --rdzv_backend c10d on MASTER_ADDR:MASTER_PORT)
#                    or static (--master_addr/--master_port/--node_rank)
#   MASTER_ADDR      default: first host of $SLURM_JOB_NODELIST; a loopback one (localhost, 127.*, ::1,
#                    e.g. exported in the submitting shell) is refused when NODES > 1
#   MASTER_PORT      1-65535; default: 20000 + SLURM_JOB_ID % 20000
#   LOG_DIR          default logs/ (in MEGALOOP_START_DIR, beside slurm-*.out); per job:
#                    $LOG_DIR/$SLURM_JOB_ID/ (node<i>.log, launch.txt, exit_code, trainer_exit)
#   VENV             virtual env to activate (default $ROOT/.venv if present; "none" = use PATH; a named one must exist)
#   IDLE_REQUEUES    requeues in a row that may end without a new checkpoint (default 2; 0 = none)
#   SHUTDOWN_TIMEOUT seconds torchrun waits for workers to checkpoint after a signal (default 110)
#   TORCHRUN_SIGNALS signals torchrun forwards (default SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1;
#                    empty = torchrun's default, for torch < 2.8 which lacks --signals-to-handle)
#   CPUS_PER_TASK    CPUs of each node's task (default $SLURM_CPUS_ON_NODE)
#   SRUN_ARGS        extra srun arguments (word-split), e.g. "--container-image=... --mpi=none"
#   OMP_NUM_THREADS  default 8
#   PLAN_CLUSTER     cluster description for the preflight: h100|h200|b200|PATH.yaml (default auto:
#                    this node's GPU; skipped where none is visible). PREFLIGHT=0 or the scripts'
#                    --no-preflight argument skips it.

megaloop_die() {
  echo "megaloop-slurm: error: $*" >&2
  exit 2
}

megaloop_log() {
  echo "[megaloop-slurm $(date '+%F %T')] $*"
}

# Where the batch script started (sbatch's directory, or its --chdir): user paths are relative to it.
MEGALOOP_START_DIR="$(pwd)"

# megaloop_abspath PATH: PATH if absolute or empty, else MEGALOOP_START_DIR/PATH (leading ./ dropped).
megaloop_abspath() {
  local p="$1"
  case "$p" in
    '' | /*) printf '%s\n' "$p" ;;
    *)
      while [ "${p#./}" != "$p" ]; do p="${p#./}"; done
      printf '%s\n' "$MEGALOOP_START_DIR${p:+/$p}"
      ;;
  esac
}

# megaloop_abspath_data VALUE: a data.path / data.val_path value; `default`, `default:<split>`, a
# URL (s3://...) and null stay as they are, a relative path becomes absolute.
megaloop_abspath_data() {
  case "$1" in
    default | default:* | *://* | null | Null | NULL | '~') printf '%s\n' "$1" ;;
    *) megaloop_abspath "$1" ;;
  esac
}

# megaloop_abspath_override KEY=VALUE: a dotlist override; the value of a path field (data.path,
# data.val_path, data.cache_dir, train.init_weights) as megaloop_abspath_data makes it, others as given.
megaloop_abspath_override() {
  case "$1" in
    data.path=* | data.val_path=* | data.cache_dir=* | train.init_weights=*)
      printf '%s\n' "${1%%=*}=$(megaloop_abspath_data "${1#*=}")" ;;
    *) printf '%s\n' "$1" ;;
  esac
}

# megaloop_abspath_file NAME: a shipped name (a preset `S`, a cluster `h100`, `zero2`) stays as it is;
# a file (with a / or a .yaml/.yml/.json suffix, or one that exists there) becomes absolute.
megaloop_abspath_file() {
  case "$1" in
    '' | /*) printf '%s\n' "$1" ;;
    */* | *.yaml | *.yml | *.json) megaloop_abspath "$1" ;;
    *)
      if [ -e "$MEGALOOP_START_DIR/$1" ]; then
        megaloop_abspath "$1"
      else
        printf '%s\n' "$1"
      fi
      ;;
  esac
}

# megaloop_user_file VALUE DEFAULT: a knob naming a preset or a file (CONFIG, DS_CONFIG): VALUE, when given,
# as megaloop_abspath_file makes it (a file of that name in MEGALOOP_START_DIR wins); else DEFAULT as it is,
# the built-in preset or shipped file, even where a file or directory of that name lies there.
megaloop_user_file() {
  if [ -n "$1" ]; then
    megaloop_abspath_file "$1"
  else
    printf '%s\n' "$2"
  fi
}

megaloop_setup() {
  [ -n "${SLURM_JOB_ID:-}" ] || megaloop_die "SLURM_JOB_ID is not set: submit this script with sbatch"
  # The time-limit / pre-emption USR1 may arrive before the launch (set-up, the preflight) or after it (a
  # follow-up evaluation in this shell): bash's default action killed the job then, with no requeue.
  MEGALOOP_EARLY_USR1=0
  trap '_megaloop_outside_launch' USR1
  [ -n "${SLURM_JOB_NODELIST:-}" ] || megaloop_die "SLURM_JOB_NODELIST is not set (not inside an allocation?)"
  LOG_DIR="$(megaloop_abspath "${LOG_DIR:-logs}")"
  local venv_named="${VENV:+1}"
  VENV="${VENV:-$ROOT/.venv}"
  if [ "$VENV" != none ]; then
    VENV="$(megaloop_abspath "$VENV")"
    [ -z "$venv_named" ] || [ -f "$VENV/bin/activate" ] ||
      megaloop_die "VENV=$VENV is not a virtual environment (no bin/activate); VENV=none uses the PATH's python"
  fi
  IDLE_REQUEUES="${IDLE_REQUEUES:-2}"
  case "$IDLE_REQUEUES" in '' | *[!0-9]*) megaloop_die "IDLE_REQUEUES must be a non-negative integer, got '$IDLE_REQUEUES'" ;; esac
  IDLE_REQUEUES="$((10#$IDLE_REQUEUES))"
  cd "$ROOT" || megaloop_die "cannot cd to $ROOT"

  if [ "$VENV" != none ] && [ -f "$VENV/bin/activate" ]; then
    export PATH="$VENV/bin:$PATH"
    export VIRTUAL_ENV="$VENV"
  fi

  local -a hosts
  mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
  [ "${#hosts[@]}" -ge 1 ] || megaloop_die "scontrol show hostnames returned no host for '$SLURM_JOB_NODELIST'"
  NODES="${NODES:-${SLURM_NNODES:-${#hosts[@]}}}"
  case "$NODES" in '' | *[!0-9]*) megaloop_die "NODES must be a positive integer, got '$NODES'" ;; esac
  [ "$NODES" -ge 1 ] || megaloop_die "NODES must be >= 1, got $NODES"
  [ "$NODES" -le "${#hosts[@]}" ] ||
    megaloop_die "NODES=$NODES but the allocation has ${#hosts[@]} node(s) (sbatch --nodes=$NODES ...)"
  NODE_LIST="$(IFS=,; echo "${hosts[*]:0:$NODES}")"
  local gpn_from=GPUS_PER_NODE
  [ -n "${GPUS_PER_NODE:-}" ] || gpn_from="GPUS_PER_NODE (from SLURM_GPUS_ON_NODE)"
  GPUS_PER_NODE="${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}"
  case "$GPUS_PER_NODE" in '' | *[!0-9]*) megaloop_die "$gpn_from must be a positive integer, got '$GPUS_PER_NODE'" ;; esac
  GPUS_PER_NODE="$((10#$GPUS_PER_NODE))"
  [ "$GPUS_PER_NODE" -ge 1 ] || megaloop_die "$gpn_from must be a positive integer, got '$GPUS_PER_NODE'"
  MASTER_ADDR="${MASTER_ADDR:-${hosts[0]}}"
  if [ "$NODES" -gt 1 ]; then
    case "$MASTER_ADDR" in
      localhost | localhost.* | ip6-localhost | 127.* | ::1 | '[::1]' | 0:0:0:0:0:0:0:1)
        megaloop_die "MASTER_ADDR=$MASTER_ADDR is a loopback address, but the job spans $NODES nodes (each would wait at its own rendezvous): unset MASTER_ADDR (default: the first host, ${hosts[0]})" ;;
    esac
  fi
  MASTER_PORT="${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}"
  case "$MASTER_PORT" in '' | *[!0-9]* | ???????*) megaloop_die "MASTER_PORT must be a port number (1-65535), got '$MASTER_PORT'" ;; esac
  MASTER_PORT="$((10#$MASTER_PORT))"
  [ "$MASTER_PORT" -ge 1 ] && [ "$MASTER_PORT" -le 65535 ] ||
    megaloop_die "MASTER_PORT must be a port number (1-65535), got '$MASTER_PORT'"
  RDZV="${RDZV:-c10d}"
  case "$RDZV" in c10d | static) ;; *) megaloop_die "RDZV must be c10d or static, got '$RDZV'" ;; esac
  SHUTDOWN_TIMEOUT="${SHUTDOWN_TIMEOUT:-110}"
  TORCHRUN_SIGNALS="${TORCHRUN_SIGNALS-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}"
  CPUS_PER_TASK="${CPUS_PER_TASK:-${SLURM_CPUS_ON_NODE:-}}"
  export MASTER_ADDR MASTER_PORT
  export CUDA_DEVICE_MAX_CONNECTIONS=1
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
  export PYTHONUNBUFFERED=1
  export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"

  JOB_LOG_DIR="$LOG_DIR/$SLURM_JOB_ID"
  mkdir -p "$JOB_LOG_DIR" 2>/dev/null && [ -w "$JOB_LOG_DIR" ] ||
    megaloop_die "LOG_DIR=$LOG_DIR: cannot create the writable folder $JOB_LOG_DIR (the job's logs)"
  [ "${SLURM_RESTART_COUNT:-0}" != 0 ] || rm -f "$JOB_LOG_DIR/idle_requeues"  # a first start: no count carried over
  megaloop_log "job $SLURM_JOB_ID${SLURM_RESTART_COUNT:+ (restart $SLURM_RESTART_COUNT)}: $NODES node(s) [$NODE_LIST]" \
    "x $GPUS_PER_NODE proc(s), rendezvous $RDZV at $MASTER_ADDR:$MASTER_PORT, logs in $JOB_LOG_DIR/"
}

_megaloop_on_signal() {
  # $1: the signal this batch shell received. USR1 = time limit / pre-emption warning: requeue once the
  # trainer has stopped to checkpoint; TERM without an earlier USR1 (`scancel --batch --signal=TERM`): stop,
  # never requeue (a TERM after the USR1, e.g. the time limit itself while the checkpoint is written, keeps
  # the requeue).
  if [ "$1" = USR1 ]; then
    MEGALOOP_REQUEUE=1
  elif [ "$MEGALOOP_REQUEUE" != 1 ]; then
    MEGALOOP_STOPPED=1
  fi
  megaloop_log "received SIG$1: forwarding SIGUSR1 to the training processes (checkpoint, then exit)"
  if [ -n "${MEGALOOP_SRUN_PID:-}" ]; then
    kill -USR1 "$MEGALOOP_SRUN_PID" 2>/dev/null || true
  fi
}

_megaloop_outside_launch() {
  # USR1 with no training processes to forward it to: the next launch requeues the job instead of starting;
  # after the launch, the follow-up work goes on (the time limit's own SIGTERM may still end it).
  MEGALOOP_EARLY_USR1=1
  megaloop_log "received SIGUSR1 outside a training launch: a launch that has not started requeues the job instead"
}

_megaloop_idle_requeue_ok() {
  # $1: the latest checkpoint before the launch; counts launches in a row that wrote none (false past IDLE_REQUEUES)
  local file="$JOB_LOG_DIR/idle_requeues" now="" idle=0
  [ -n "${MEGALOOP_LATEST:-}" ] || return 0
  now="$(cat "$MEGALOOP_LATEST" 2>/dev/null || true)"
  if [ -n "$now" ] && [ "$now" != "$1" ]; then
    echo 0 >"$file"
    return 0
  fi
  [ ! -f "$file" ] || idle="$(tr -dc '0-9' <"$file" || true)"
  idle="$((10#${idle:-0} + 1))"
  echo "$idle" >"$file"
  [ "$idle" -gt "$IDLE_REQUEUES" ] || return 0
  megaloop_log "not requeued: the last $idle start(s) in a row stopped without a new checkpoint in $(dirname "$MEGALOOP_LATEST")" \
    "(IDLE_REQUEUES=$IDLE_REQUEUES; e.g. the time-limit warning arrives during set-up: give the job a longer --time); submit it again to resume"
  return 1
}

megaloop_train() {
  [ "$#" -ge 2 ] || megaloop_die "megaloop_train CONFIG RUN_DIR [KEY=VALUE ...]"
  local config="$1" run_dir="$2"
  shift 2
  MEGALOOP_LATEST="$run_dir/checkpoints/latest"
  megaloop_launch -m megaloop.cli train --config "$config" --run-dir "$run_dir" --resume auto "$@"
}

# megaloop_post_main VERB DS_CONFIG SAVE_EVERY ARGS...: a DeepSpeed post-training command (`megaloop rl`,
# `megaloop distill-prefill`) on every node, writing to $OUT, resumed from $OUT/checkpoints when a
# checkpoint is there; EXTRA_ARGS (word-split) are appended. Exits with the command's status. DS_CONFIG
# as passed to --deepspeed (the caller makes a user's file absolute: megaloop_user_file).
megaloop_post_main() {
  [ "$#" -ge 3 ] || megaloop_die "megaloop_post_main VERB DS_CONFIG SAVE_EVERY [ARGS...]"
  local verb="$1" ds="$2" every="$3" rc=0
  local -a cmd extra
  shift 3
  case "$every" in '' | *[!0-9]*) megaloop_die "SAVE_EVERY must be a non-negative integer, got '$every'" ;; esac
  OUT="$(megaloop_abspath "$OUT")"
  megaloop_setup
  cmd=(-m megaloop.cli "$verb" "$@" --out "$OUT" --deepspeed "$ds" --save-every "$every")
  if [ -f "$OUT/checkpoints/latest" ]; then
    cmd+=(--resume)
  fi
  read -r -a extra <<<"${EXTRA_ARGS:-}"
  megaloop_post_extra "${extra[@]}"
  if [ -f "$OUT/checkpoints/latest" ]; then
    # --overwrite restarts a run that stopped before its first checkpoint; once that run has checkpointed,
    # a requeued job (same EXTRA_ARGS) resumes it, and --resume with --overwrite is refused
    local -a kept=()
    local arg
    for arg in "${POST_EXTRA[@]}"; do
      if [ "$arg" = "--overwrite" ]; then
        megaloop_log "$OUT holds a checkpoint: resuming it; EXTRA_ARGS' --overwrite (for a run with none) is not passed"
      else
        kept+=("$arg")
      fi
    done
    POST_EXTRA=("${kept[@]}")
  fi
  cmd+=("${POST_EXTRA[@]}")
  MEGALOOP_LATEST="$OUT/checkpoints/latest"
  megaloop_launch "${cmd[@]}" || rc=$?
  [ "$rc" -ne 2 ] || [ ! -f "$OUT/checkpoints/latest" ] ||  # e.g. changed settings refused on --resume
    megaloop_log "if it refused changed settings: under this script a new OUT starts afresh (EXTRA_ARGS' --overwrite is not passed while $OUT holds a checkpoint)"
  exit "$rc"
}

# megaloop_post_extra ARGS...: EXTRA_ARGS of a post-training command into the array POST_EXTRA, with the
# path a --tokenizer names made absolute (`default` and `bytes` stay; `--tokenizer=PATH` too), and the
# file of a --task gsm8k:/exact:/mbpp:FILE (mbpp:tiny stays), as the TASK knob's is.
megaloop_post_extra() {
  local prev="" arg
  POST_EXTRA=()
  for arg in "$@"; do
    case "$prev" in
      --tokenizer) arg="$(megaloop_post_tokenizer "$arg")" ;;
      --task) arg="$(megaloop_post_task "$arg")" ;;
    esac
    case "$arg" in
      --tokenizer=*) arg="--tokenizer=$(megaloop_post_tokenizer "${arg#--tokenizer=}")" ;;
      --task=*) arg="--task=$(megaloop_post_task "${arg#--task=}")" ;;
    esac
    POST_EXTRA+=("$arg")
    prev="$arg"
  done
}

megaloop_post_tokenizer() {
  case "$1" in
    default | bytes | "") printf '%s\n' "$1" ;;
    *) megaloop_abspath "$1" ;;
  esac
}

megaloop_post_task() {
  case "$1" in
    mbpp:tiny) printf '%s\n' "$1" ;;
    gsm8k:?* | exact:?* | mbpp:?*) printf '%s\n' "${1%%:*}:$(megaloop_abspath "${1#*:}")" ;;
    *) printf '%s\n' "$1" ;;
  esac
}

megaloop_launch() {
  [ "$#" -ge 1 ] || megaloop_die "megaloop_launch PYTHON_ARGS..."
  local -a launcher train srun_opts extra_srun
  launcher=(torchrun --nnodes "$NODES" --nproc_per_node "$GPUS_PER_NODE" --max_restarts 0
    --shutdown-timeout "$SHUTDOWN_TIMEOUT")
  if [ -n "$TORCHRUN_SIGNALS" ]; then
    launcher+=(--signals-to-handle "$TORCHRUN_SIGNALS")
  fi
  if [ "$RDZV" = static ]; then
    launcher+=(--master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
  else
    launcher+=(--rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "$SLURM_JOB_ID")
  fi
  train=("$@")
  srun_opts=(--nodes="$NODES" --ntasks="$NODES" --ntasks-per-node=1 --nodelist="$NODE_LIST"
    --kill-on-bad-exit=1 --output="$JOB_LOG_DIR/node%n.log" --open-mode=append)
  if [ -n "$CPUS_PER_TASK" ]; then
    srun_opts+=(--cpus-per-task="$CPUS_PER_TASK")
  fi
  read -r -a extra_srun <<<"${SRUN_ARGS:-}"
  srun_opts+=("${extra_srun[@]}")

  {
    echo "time: $(date '+%F %T')  restart: ${SLURM_RESTART_COUNT:-0}"
    echo "srun ${srun_opts[*]} ${launcher[*]} --node_rank \$SLURM_NODEID ${train[*]}"
  } >>"$JOB_LOG_DIR/launch.txt"
  megaloop_log "torchrun ${train[*]}"

  # torchrun exits 1 whenever a worker fails; global rank 0 writes the trainer's own status here
  MEGALOOP_EXIT_STATUS_FILE="$(cd "$JOB_LOG_DIR" && pwd)/trainer_exit"
  export MEGALOOP_EXIT_STATUS_FILE
  rm -f "$MEGALOOP_EXIT_STATUS_FILE"
  MEGALOOP_REQUEUE=0
  MEGALOOP_STOPPED=0
  MEGALOOP_SRUN_PID=""
  local latest_before=""  # the run's newest checkpoint now: a requeue after none was written counts as idle
  [ -z "${MEGALOOP_LATEST:-}" ] || latest_before="$(cat "$MEGALOOP_LATEST" 2>/dev/null || true)"
  trap '_megaloop_on_signal USR1' USR1
  trap '_megaloop_on_signal TERM' TERM
  if [ "${MEGALOOP_EARLY_USR1:-0}" = 1 ]; then  # the warning came during set-up: no time left to train
    megaloop_log "SIGUSR1 arrived before the launch: not starting ${train[*]:0:3}"
    MEGALOOP_REQUEUE=1
    (exit 75) &  # stands for the launch: its checkpoint-and-requeue status
  else
    # One task per node; its node rank is that task's $SLURM_NODEID, expanded on the node itself.
    # shellcheck disable=SC2016
    srun "${srun_opts[@]}" bash -c 'exec "$0" --node_rank "$SLURM_NODEID" "$@"' \
      "${launcher[@]}" "${train[@]}" &
  fi
  MEGALOOP_SRUN_PID=$!
  local rc
  while :; do
    rc=0
    wait "$MEGALOOP_SRUN_PID" || rc=$?
    # A trapped signal interrupts `wait` (status > 128) while srun keeps running: wait again.
    if [ "$rc" -gt 128 ] && kill -0 "$MEGALOOP_SRUN_PID" 2>/dev/null; then
      continue
    fi
    break
  done
  trap '_megaloop_outside_launch' USR1
  trap - TERM
  if [ "$rc" -ne 0 ] && [ -s "$MEGALOOP_EXIT_STATUS_FILE" ]; then
    local own
    own="$(tr -dc '0-9' <"$MEGALOOP_EXIT_STATUS_FILE")"
    rc="${own:-$rc}"
  fi
  echo "$rc" >"$JOB_LOG_DIR/exit_code"
  megaloop_log "${train[*]:0:3} exited with status $rc"
  # Requeue: the trainer stopped to checkpoint (75), or after USR1 it could not report its status (torchrun's
  # 1); not when it finished (0) or refused (2) in the meantime, and never after this shell's SIGTERM.
  if [ "$MEGALOOP_STOPPED" = 1 ]; then
    [ "$rc" -ne 75 ] || megaloop_log "stopped by SIGTERM: not requeued (sbatch again to resume)"
  elif [ "$rc" -eq 75 ] || { [ "$MEGALOOP_REQUEUE" = 1 ] && [ "$rc" -ne 0 ] && [ "$rc" -ne 2 ]; }; then
    _megaloop_idle_requeue_ok "$latest_before" || return 75
    megaloop_log "requeueing job $SLURM_JOB_ID (the next start resumes from the latest checkpoint)"
    scontrol requeue "$SLURM_JOB_ID" || megaloop_log "scontrol requeue failed (is the job --requeue-able?)"
    return 75
  fi
  return "$rc"
}

# megaloop_config_facts CONFIG GIVEN: what CONFIG (a preset or a YAML file, `base:` followed, read by
# megaloop's own loader here, in the directory the trainer runs in) sets itself, for the knobs whose default
# only fills a gap: MEGALOOP_CFG_DATA (its data.path; `default` where it sets none, megaloop's default),
# MEGALOOP_CFG_VAL and MEGALOOP_CFG_WANDB (1 where it sets data.val_path / logging.wandb, else 0). Where it
# cannot be read (no python with megaloop on this node, e.g. a container in SRUN_ARGS; a broken file, which
# the preflight or the trainer names): the built-in preset (GIVEN=0) is taken to set none of them (the
# shipped S, M, L and tiny set none), a CONFIG the user gave (GIVEN=1) to set them all (so no default is
# put over its settings), with a warning.
megaloop_config_facts() {
  local config="$1" given="$2" out rc=0
  local -a facts
  out="$(python -W ignore - "$config" 2>&1 <<'PY'
import sys

from megaloop.config import resolve_config_path
from megaloop.config_utils import load_yaml

data = load_yaml(resolve_config_path(sys.argv[1]))


def get(key):
    node = data
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


has_path, path = get("data.path")
print(path if has_path and path is not None else "default")
print(int(get("data.val_path")[0]))
print(int(get("logging.wandb")[0]))
PY
)" || rc=$?
  mapfile -t facts <<<"$out"
  if [ "$rc" -eq 0 ] && [ "${#facts[@]}" -eq 3 ]; then
    MEGALOOP_CFG_DATA="${facts[0]}" MEGALOOP_CFG_VAL="${facts[1]}" MEGALOOP_CFG_WANDB="${facts[2]}"
  elif [ "$given" = 1 ]; then
    megaloop_log "warning: could not read CONFIG=$config here ($(printf '%s\n' "$out" | tail -n 1)): its data and" \
      "logging settings stand; no VAL_PATH or WANDB_MODE default is added (set them to choose)"
    MEGALOOP_CFG_DATA="?" MEGALOOP_CFG_VAL=1 MEGALOOP_CFG_WANDB=1
  else
    MEGALOOP_CFG_DATA=default MEGALOOP_CFG_VAL=0 MEGALOOP_CFG_WANDB=0
  fi
}

# The knobs of slurm/train_*.sh as dotlist overrides, in the array OVERRIDES. A knob is passed only where it
# is set (non-empty), so a CONFIG file's own settings stand otherwise (the preflight gets the same
# overrides); two defaults fill gaps: data.val_path=default:val where the run trains on the embedded corpus
# (data.path `default`, from DATA_PATH, EXTRA_ARGS, the config or megaloop's default) and nothing sets a
# validation set, and logging.wandb=offline where neither WANDB_MODE, the config nor EXTRA_ARGS sets it.
# Needs CONFIG and MEGALOOP_CONFIG_GIVEN (1: CONFIG was the user's) and runs after megaloop_setup.
megaloop_scale_overrides() {
  local -a extra
  local ov data val_set=0 wandb_set=0
  megaloop_config_facts "$CONFIG" "${MEGALOOP_CONFIG_GIVEN:-0}"
  data="$MEGALOOP_CFG_DATA"
  [ "$MEGALOOP_CFG_VAL" != 1 ] || val_set=1
  [ "$MEGALOOP_CFG_WANDB" != 1 ] || wandb_set=1
  OVERRIDES=()
  if [ -n "$TP" ]; then
    OVERRIDES+=("parallel.tp=$TP")
  fi
  if [ -n "$PP" ]; then
    OVERRIDES+=("parallel.pp=$PP")
  fi
  if [ -n "$VPP" ]; then
    OVERRIDES+=("parallel.vpp=$VPP")
  fi
  if [ -n "$DATA_PATH" ]; then
    OVERRIDES+=("data.path=$DATA_PATH")
    data="$DATA_PATH"
  fi
  if [ -n "$VAL_PATH" ]; then
    OVERRIDES+=("data.val_path=$VAL_PATH")
    val_set=1
  fi
  read -r -a extra <<<"$EXTRA_ARGS"
  for ov in "${extra[@]}"; do  # EXTRA_ARGS come last: they win
    case "$ov" in
      data.path=*) data="${ov#*=}" ;;
      data.val_path=*) val_set=1 ;;
      logging.wandb=*) wandb_set=1 ;;
    esac
  done
  case "$data" in
    default | default:*)
      megaloop_log "warning: training on the small embedded corpus (data.path=$data; set DATA_PATH): a smoke test"
      if [ "$val_set" = 0 ] && { [ "$data" = default ] || [ "$data" = default:train ]; }; then
        OVERRIDES+=("data.val_path=default:val")
      fi
      ;;
  esac
  if [ -n "$WANDB_MODE" ]; then
    export WANDB_MODE
    OVERRIDES+=("logging.wandb=$WANDB_MODE")
  elif [ "$wandb_set" = 0 ]; then
    export WANDB_MODE=offline
    OVERRIDES+=("logging.wandb=offline")
  fi
  if [ -n "$WANDB_PROJECT" ]; then
    export WANDB_PROJECT
    OVERRIDES+=("logging.project=$WANDB_PROJECT")
  fi
  OVERRIDES+=("logging.progress=false")
  if [ -n "${WANDB_NAME:-}" ]; then
    OVERRIDES+=("logging.name=$WANDB_NAME")
  fi
  for ov in "${extra[@]}"; do
    OVERRIDES+=("$(megaloop_abspath_override "$ov")")
  done
}

# Predicted memory per GPU of the layout (megaloop/plan): refuse, exit 2 with one line, a layout
# predicted not to fit. A configuration `megaloop plan` refuses (its exit 2: bad input, one line
# naming the field, by the trainer's own rules; or a bad PLAN_CLUSTER) exits 2 with that line as well,
# before anything is launched: every rank would refuse it. Any other failure (no usable python, a
# planner crash) is logged as a warning and the launch goes on: the trainer validates the config itself.
megaloop_preflight() {
  [ "$#" -ge 3 ] || megaloop_die "megaloop_preflight CONFIG WORLD GPUS_PER_NODE [KEY=VALUE ...]"
  local config="$1" world="$2" gpn="$3" cluster out rc=0
  shift 3
  cluster="${PLAN_CLUSTER:-auto}"
  if [ "$cluster" != auto ]; then
    cluster="$(megaloop_abspath_file "$cluster")"
  fi
  out="$(python -m megaloop.cli plan --preflight --config "$config" --gpus "$world" \
    --cluster "$cluster" "cluster.gpus_per_node=$gpn" "$@" 2>&1)" || rc=$?
  if [ "$rc" -ne 0 ] && [[ "$out" == *"megaloop preflight: refusing"* ]]; then
    printf '%s\n' "$out" | grep "megaloop preflight: refusing" | tail -n 1 >&2
    exit 2
  fi
  if [ "$rc" -eq 2 ]; then
    local line
    line="$(printf '%s\n' "$out" | grep -E '^megaloop plan: error' | tail -n 1)"
    line="${line/error: --cluster/error: PLAN_CLUSTER (--cluster)}"  # the knob the user set, not the flag
    echo "megaloop preflight: refusing: ${line:-$(printf '%s\n' "$out" | tail -n 1)}; nothing launched" >&2
    exit 2
  fi
  if [ "$rc" -ne 0 ]; then
    echo "megaloop preflight: warning: could not plan this layout ($(printf '%s\n' "$out" | tail -n 1)); launching anyway"
  else
    printf '%s\n' "$out" | tail -n 1
  fi
}

# The body of slurm/train_{S,M,L}.sh: knob defaults for preset $1, then set-up, preflight and
# training. Arguments after $1 (sbatch slurm/train_L.sh --no-preflight): --no-preflight only.
megaloop_scale_main() {
  local preset="$1" arg
  shift
  PREFLIGHT="${PREFLIGHT:-1}"
  for arg in "$@"; do
    case "$arg" in
      --no-preflight) PREFLIGHT=0 ;;
      *) megaloop_die "unknown argument '$arg' (the only one is --no-preflight; settings are environment knobs)" ;;
    esac
  done
  # A CONFIG the user gives: a file there wins over a preset of that name (megaloop_abspath_file); the
  # script's own preset stays the preset, whatever lies in the submission directory.
  MEGALOOP_CONFIG_GIVEN=0
  [ -z "${CONFIG:-}" ] || MEGALOOP_CONFIG_GIVEN=1
  CONFIG="$(megaloop_user_file "${CONFIG:-}" "$preset")"
  RUN_DIR="$(megaloop_abspath "${RUN_DIR:-runs/$preset}")"
  # Unset (empty) knobs leave the config's settings (or megaloop's defaults: TP 1, PP 1, the embedded
  # corpus, project megaloop) in place: megaloop_scale_overrides.
  TP="${TP:-}"
  PP="${PP:-}"
  VPP="${VPP:-}"
  DATA_PATH="$(megaloop_abspath_data "${DATA_PATH:-}")"
  VAL_PATH="$(megaloop_abspath_data "${VAL_PATH:-}")"
  WANDB_MODE="${WANDB_MODE:-}"
  WANDB_PROJECT="${WANDB_PROJECT:-}"
  EXTRA_ARGS="${EXTRA_ARGS:-}"
  megaloop_setup
  megaloop_scale_overrides
  if [ "$PREFLIGHT" != 0 ]; then
    megaloop_preflight "$CONFIG" "$((NODES * GPUS_PER_NODE))" "$GPUS_PER_NODE" "${OVERRIDES[@]}"
  fi
  megaloop_train "$CONFIG" "$RUN_DIR" "${OVERRIDES[@]}"
}
