#!/usr/bin/env bash
# Train on this machine (one node) under torchrun, with the same arguments as slurm/train.sbatch:
#
#   launch/local.sh [--nproc N] [--max-restarts N] <config.yaml> [section.key=value ...]
#
# * --nproc: processes (default GOAT_NPROC, else the number of GPUs nvidia-smi lists, else 1).
# * First `goat-dist doctor` on all processes, then `goat-dist train`. A failed run (a crash) is started
#   again, resuming from the latest checkpoint, at most --max-restarts times in a row (default 3).
# * Ctrl-C, SIGTERM or SIGUSR1 stop the run at the next step boundary with a checkpoint (SIGTERM/USR1 are
#   passed to torchrun as SIGTERM: torchrun itself dies of SIGUSR1); the script then exits 75, and the
#   same command continues the run. train.stop_at / train.time_limit_minutes stop it the same way.
# * Exit status: 0 finished, 75 checkpointed (run again to continue), 1 failed, 2 bad arguments.
# * GOAT_SITE_ENV=file: source a site file first (e.g. slurm/site.env for modules and NCCL settings).
# * Exports CUDA_DEVICE_MAX_CONNECTIONS=1, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True and
#   TORCH_NCCL_ASYNC_ERROR_HANDLING=3 where not already set (`slurm/goat_slurm.py env`).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
log() { printf '[goat-local] %s %s\n' "$(date '+%F %T')" "$*"; }
die() {
    local code="$1"
    shift
    log "ERROR: $*" >&2
    exit "$code"
}

MAX_RESTARTS="${GOAT_MAX_RESTARTS:-3}"
NPROC="${GOAT_NPROC:-}"
while [[ $# -gt 0 ]]; do
    case "$1" in
    --max-restarts | --nproc)
        [[ $# -ge 2 ]] || die 2 "$1 needs a number"
        if [[ "$1" == --nproc ]]; then NPROC="$2"; else MAX_RESTARTS="$2"; fi
        shift 2
        ;;
    --max-restarts=*)
        MAX_RESTARTS="${1#*=}"
        shift
        ;;
    --nproc=*)
        NPROC="${1#*=}"
        shift
        ;;
    -h | --help)
        sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'
        exit 0
        ;;
    --)
        shift
        break
        ;;
    -*) die 2 "unknown option $1 (options go before the config file)" ;;
    *) break ;;
    esac
done
[[ $# -ge 1 ]] || die 2 "usage: launch/local.sh [--nproc N] [--max-restarts N] <config.yaml> [overrides...]"
CONFIG="$1"
shift
OVERRIDES=("$@")
if [[ -z "$NPROC" ]]; then
    NPROC=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
    [[ "$NPROC" -gt 0 ]] || NPROC=1
fi
[[ "$NPROC" =~ ^[1-9][0-9]*$ ]] || die 2 "--nproc must be a positive integer, got '$NPROC'"
[[ "$MAX_RESTARTS" =~ ^[0-9]+$ ]] || die 2 "--max-restarts must be a non-negative integer, got '$MAX_RESTARTS'"

if [[ -n "${GOAT_SITE_ENV:-}" ]]; then
    [[ -f "$GOAT_SITE_ENV" ]] || die 2 "GOAT_SITE_ENV=$GOAT_SITE_ENV not found"
    set +u
    # shellcheck source=/dev/null
    source "$GOAT_SITE_ENV"
    set -u
fi
PY="${GOAT_PYTHON:-python}"
command -v "$PY" >/dev/null || die 2 "'$PY' not found: activate the venv first"
HELPER=("$PY" "$ROOT/slurm/goat_slurm.py")
# set before Python starts (CUDA reads them when it creates its context), unless already set: as
# slurm/train.sbatch does (goat_slurm.py env)
LAUNCH_ENV=$("${HELPER[@]}" env) || die 2 "slurm/goat_slurm.py env failed (see above)"
while IFS= read -r VAR; do
    [[ -z "$VAR" ]] || export "${VAR?}"
done <<<"$LAUNCH_ENV"
RUN_DIR=$("${HELPER[@]}" run-dir "$CONFIG" "${OVERRIDES[@]}") || die 2 "bad config or overrides (see above)"
mkdir -p "$RUN_DIR"
# a launcher's variables from a surrounding world would hijack torchrun's rendezvous
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT GROUP_RANK
TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc_per_node="$NPROC")
JOB_ID="local-$(hostname -s)-$$"
log "$NPROC process(es) on $(hostname -s); config $CONFIG ${OVERRIDES[*]}; run dir $RUN_DIR"

STEP_PID=""
STEP_RC=0
STOP_SIGNAL=""
# shellcheck disable=SC2317  # on_signal runs from the traps below
on_signal() {
    [[ -n "$STOP_SIGNAL" ]] || log "got SIG$1: the run checkpoints at the next step boundary"
    STOP_SIGNAL="$1"
    # Ctrl-C already reached every process of the foreground group; TERM/USR1 were sent to this script only
    if [[ "$1" != INT && -n "$STEP_PID" ]]; then
        kill -TERM "$STEP_PID" 2>/dev/null || true
    fi
}
trap 'on_signal INT' INT
trap 'on_signal TERM' TERM
trap 'on_signal USR1' USR1

run_step() {
    "$@" &
    STEP_PID=$!
    local rc
    while :; do
        rc=0
        wait "$STEP_PID" || rc=$?
        kill -0 "$STEP_PID" 2>/dev/null || break
    done
    STEP_RC=$rc
    STEP_PID=""
}

log "preflight: goat-dist doctor"
run_step "${TORCHRUN[@]}" -m goat_dist doctor --config "$CONFIG" "${OVERRIDES[@]}"
[[ -z "$STOP_SIGNAL" ]] || die 75 "stopped by SIG$STOP_SIGNAL before training started"
[[ $STEP_RC -eq 0 ]] || die 1 "preflight failed (exit $STEP_RC): see the goat-dist doctor FAIL lines above"

attempt=1
while :; do
    "${HELPER[@]}" begin "$RUN_DIR" --job-id "$JOB_ID"
    log "training (attempt $attempt)"
    run_step "${TORCHRUN[@]}" -m goat_dist train --config "$CONFIG" "${OVERRIDES[@]}"
    ACTION=$("${HELPER[@]}" decide "$RUN_DIR" --mode local --job-id "$JOB_ID" --exit-code "$STEP_RC" \
        --max-restarts "$MAX_RESTARTS") || ACTION=error
    if [[ -n "$STOP_SIGNAL" && "$ACTION" == requeue ]]; then
        ACTION=stop # stopped on request: never restart by ourselves
    fi
    case "$ACTION" in
    done) exit 0 ;;
    stop) die 75 "checkpointed: run the same command again to continue" ;;
    requeue) attempt=$((attempt + 1)) ;;
    give-up) die 1 "giving up: the error is in the training output above" ;;
    *) die 1 "could not decide what to do after training (see above)" ;;
    esac
done
