# shellcheck shell=bash
# megaloop_local_run CMD...: run a torchrun command line on this machine and exit with the trainer's
# own status. Sourced by launch/torchrun.sh and launch/train_single_node.sh.
#
# - torchrun runs in its own session, so a signal reaches the workers exactly once: through this
#   shell, which forwards SIGTERM, SIGUSR1, SIGINT (Ctrl-C: the terminal signals this shell's group
#   only) and SIGHUP (forwarded as SIGTERM: the trainer checkpoints on it) to torchrun, and torchrun
#   (--signals-to-handle) to its workers. A signal sent to the whole group (`timeout`, `kill -- -PGID`)
#   is forwarded once too.
# - torchrun exits 1 whenever a worker exits non-zero; the trainer's own status (75: checkpointed
#   after a signal, resume me; 130: Ctrl-C after a checkpoint; 2: refused; 3: non-finite loss) comes
#   back through MEGALOOP_EXIT_STATUS_FILE, which global rank 0 writes on its way out.
megaloop_local_run() {
  local status_file pid rc sig
  status_file="$(mktemp "${TMPDIR:-/tmp}/megaloop-exit.XXXXXX")"
  : >"$status_file"
  export MEGALOOP_EXIT_STATUS_FILE="$status_file"
  setsid "$@" &
  pid=$!
  for sig in TERM USR1 INT HUP; do
    # shellcheck disable=SC2064  # $pid and $sig are meant to expand now
    trap "_megaloop_forward $sig $pid" "$sig"
  done
  while :; do
    rc=0
    wait "$pid" || rc=$?
    # a trapped signal interrupts `wait` (status > 128) while torchrun keeps running: wait again
    if [ "$rc" -gt 128 ] && kill -0 "$pid" 2>/dev/null; then
      continue
    fi
    break
  done
  trap - TERM USR1 INT HUP
  if [ "$rc" -ne 0 ] && [ -s "$status_file" ]; then
    rc="$(tr -dc '0-9' <"$status_file")"
    rc="${rc:-1}"
  fi
  rm -f "$status_file"
  return "$rc"
}

_megaloop_forward() {
  local sig="$1" pid="$2"
  [ "$sig" = HUP ] && sig=TERM
  echo "megaloop: received SIG$1: forwarding SIG$sig to torchrun (the workers checkpoint, then stop)" >&2
  kill -s "$sig" "$pid" 2>/dev/null || true
}
