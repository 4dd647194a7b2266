#!/usr/bin/env bash
# The GPU check, in one command on one CUDA machine (sized for 8 minutes on one H200, cold cache):
#   R. the rehearsal first (goat-dist plan --rehearse: the 30B config's rank 511 of 64 x 8, cut to 2 blocks,
#      the GPU stood in by the meta device; seconds): a fault it names would fail the runs below anyway;
#   0. installs the `gpu` extra (FlashAttention-4 and its dependencies) from wheels only, never an sdist,
#      with the installed torch pinned (a CUDA 13 torch gets FA4's cu13 libraries);
#      GOAT_SKIP_INSTALL=1 skips it where the environment is prepared already;
#   1. bench/gpu_train.py: an NCCL smoke run of `goat-dist train` (bf16, checkpoint at step 10, resume to
#      30) and the end-to-end MFU of the 125M and 1.3B configs;
#   2. bench/gpu_tp2.py, with two GPUs or more: TP=2 over NCCL through an evaluation at step 5 (the TP
#      and DP groups are NCCL only: a host tensor reduced on them fails there), a checkpoint-and-stop on
#      SIGTERM, a resume and `eval ppl` at DP=2; on one GPU it says so and skips;
#   3. tests/gpu (bf16 parity of flash4 / FA2 / sdpa for GOAT up to L=16k, the flash4 log-sum-exp, the
#      bf16 long-sequence error against float64);
#   4. bench/gpu_attention.py: GOAT against plain attention in the same kernel (flash4, FA2, sdpa),
#      forward + backward TFLOP/s at head dims 64 and 128, L = 2k to 32k.
#
#   bash bench/gpu_suite.sh [--dry-run] [OUT_DIR]     # default runs/gpu_suite; $OUT is used when set
#
# --dry-run prints the plan (every command with its timeout) and checks that its inputs exist, on any
# machine; it runs nothing. Every part has a timeout (GOAT_{INSTALL,TRAIN,TP2,TESTS,BENCH}_TIMEOUT, seconds)
# and leaves what it finished: gpu_train.json after each run, tests.jsonl after each test,
# gpu_attention.json after each row, suite.json after each part. FA4 compiles each kernel shape at its
# first call (tens of seconds); its compiled kernels go to an on-disk cache
# (FLASH_ATTENTION_CUTE_DSL_CACHE_DIR, default ~/.cache/goat-dist/fa4-cute), so the training runs, the
# tests and the bench compile each shape once.
#
# goat-dist itself must already be importable (launch/setup.sh, or PYTHONPATH). Without network access,
# download the wheels elsewhere first and point GOAT_WHEELHOUSE at them (docs/performance.md).
# docs/performance.md keeps the figures of each run on a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY=1; shift; fi
OUT_DIR=${1:-${OUT:-runs/gpu_suite}}
PY=${PYTHON:-python3}
export DS_ACCELERATOR=cuda PYTHONUNBUFFERED=1
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
export FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=${FLASH_ATTENTION_CUTE_DSL_CACHE_DIR:-$HOME/.cache/goat-dist/fa4-cute}
INSTALL_TIMEOUT=${GOAT_INSTALL_TIMEOUT:-240}
TRAIN_TIMEOUT=${GOAT_TRAIN_TIMEOUT:-250}
TP2_TIMEOUT=${GOAT_TP2_TIMEOUT:-200}
TESTS_TIMEOUT=${GOAT_TESTS_TIMEOUT:-140}
BENCH_TIMEOUT=${GOAT_BENCH_TIMEOUT:-140}
REHEARSE_TIMEOUT=${GOAT_REHEARSE_TIMEOUT:-90}

# the gpu extra's requirements, read from pyproject.toml (a CUDA 13 torch: flash-attn-4[cu13])
gpu_requirements() {
  "$PY" - <<'PY'
import re
try:
    import tomllib
    extra = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["gpu"]
except ModuleNotFoundError:  # Python 3.10: the one-line list in pyproject.toml
    line = next(l for l in open("pyproject.toml") if l.startswith("gpu = ["))
    extra = re.findall(r'"([^"]+)"', line)
try:
    import torch
    cu13 = (torch.version.cuda or "").startswith("13")
except ImportError:
    cu13 = False
print("\n".join(re.sub(r"^flash-attn-4(?=[<>=!~ ]|$)", "flash-attn-4[cu13]", r) if cu13 else r for r in extra))
PY
}

TORCH_PIN=$("$PY" -c "import torch; print('torch==' + torch.__version__)" 2>/dev/null || echo "")
mapfile -t REQS < <(gpu_requirements)
PIP_ARGS=(--only-binary=:all:)
if [[ -n "${GOAT_WHEELHOUSE:-}" ]]; then PIP_ARGS+=(--no-index --find-links "$GOAT_WHEELHOUSE"); fi
CONSTRAINTS="$OUT_DIR/constraints.txt"  # the installed torch stays: pip never swaps it for another build
INSTALL_CMD=("$PY" -m pip install -q "${PIP_ARGS[@]}")
if [[ -n "$TORCH_PIN" ]]; then INSTALL_CMD+=(-c "$CONSTRAINTS"); fi
INSTALL_CMD+=("${REQS[@]}")
REHEARSE_CMD=("$PY" -m goat_dist plan --config configs/models/goat_30b.yaml --nodes 64 --gpus-per-node 8 --rehearse
              --layers 2)
TRAIN_CMD=("$PY" bench/gpu_train.py --out "$OUT_DIR")
TP2_CMD=("$PY" bench/gpu_tp2.py --out "$OUT_DIR")
# one process on the GPU (pyproject's addopts start pytest-xdist workers, which the device may not have)
TESTS_CMD=("$PY" -m pytest tests/gpu -q -rs -p no:cacheprovider -p no:xdist -o addopts= --ignore=tests/gpu/test_suite_script.py)
# shellcheck disable=SC2206  # GOAT_ATTENTION_ARGS is a list of flags
BENCH_CMD=("$PY" bench/gpu_attention.py --out "$OUT_DIR" ${GOAT_ATTENTION_ARGS:-})

if [[ $DRY -eq 1 ]]; then
  echo "plan (output: $OUT_DIR; FA4 kernel cache: $FLASH_ATTENTION_CUTE_DSL_CACHE_DIR)"
  echo "  rehearse timeout ${REHEARSE_TIMEOUT}s: ${REHEARSE_CMD[*]}"
  if [[ -z "${GOAT_SKIP_INSTALL:-}" ]]; then
    echo "  install  timeout ${INSTALL_TIMEOUT}s: ${INSTALL_CMD[*]}${TORCH_PIN:+   ($CONSTRAINTS: $TORCH_PIN)}"
  else
    echo "  install  skipped (GOAT_SKIP_INSTALL)"
  fi
  echo "  train    timeout ${TRAIN_TIMEOUT}s: ${TRAIN_CMD[*]}"
  echo "  tp2      timeout ${TP2_TIMEOUT}s: ${TP2_CMD[*]}   (2+ GPUs; skipped with a message on one)"
  echo "  tests    timeout ${TESTS_TIMEOUT}s: GOAT_TESTS_JSONL=$OUT_DIR/tests.jsonl ${TESTS_CMD[*]}"
  echo "  bench    timeout ${BENCH_TIMEOUT}s: ${BENCH_CMD[*]}"
  missing=0
  for path in pyproject.toml bench/gpu_train.py bench/gpu_tp2.py bench/gpu_attention.py tests/gpu configs/tiny.yaml \
      configs/models/goat_125m.yaml configs/models/goat_1.3b.yaml configs/models/goat_30b.yaml; do
    if [[ ! -e "$path" ]]; then echo "  MISSING $path"; missing=1; fi
  done
  if [[ ${#REQS[@]} -eq 0 || -z "${REQS[0]}" ]]; then echo "  MISSING the gpu extra in pyproject.toml"; missing=1; fi
  if ! "$PY" -c "import goat_dist.kernels" 2>/dev/null; then
    echo "  MISSING an importable goat_dist with torch ($PY)"; missing=1
  fi
  [[ $missing -eq 0 ]] && echo "inputs: all present"
  exit $missing
fi

mkdir -p "$OUT_DIR"
t0=$(date +%s)
declare -A RC SECONDS_OF
write_suite() {  # suite.json so far: a run cut short still says which parts finished and how
  local parts="" key
  for key in rehearse install train tp2 tests bench; do
    [[ -n "${RC[$key]:-}" ]] && parts+="\"${key}_rc\": ${RC[$key]}, \"${key}_s\": ${SECONDS_OF[$key]}, "
  done
  echo "{${parts}\"total_s\": $(( $(date +%s) - t0 )), \"fa4_cache\": \"$FLASH_ATTENTION_CUTE_DSL_CACHE_DIR\"}" \
    > "$OUT_DIR/suite.json"
}
part() {  # part NAME TIMEOUT COMMAND...: run it under its timeout, record exit code and seconds
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  timeout --kill-after=10 "$limit" "$@"
  rc=$?
  [[ $rc -eq 124 || $rc -eq 137 ]] && echo "== $name: timed out after ${limit}s"
  RC[$name]=$rc
  SECONDS_OF[$name]=$(( $(date +%s) - start ))
  echo "== $name: exit $rc, ${SECONDS_OF[$name]} s"
  write_suite
}

echo "== the rehearsal: one rank's step of the 30B job at 64 x 8, the GPU stood in (goat-dist plan --rehearse)"
part rehearse "$REHEARSE_TIMEOUT" "${REHEARSE_CMD[@]}" > >(tee "$OUT_DIR/rehearsal.txt") 2>&1

if [[ -z "${GOAT_SKIP_INSTALL:-}" ]]; then
  echo "== installing the gpu extra from wheels: ${REQS[*]} (${TORCH_PIN:-torch not importable})"
  [[ -n "$TORCH_PIN" ]] && echo "$TORCH_PIN" > "$CONSTRAINTS"
  part install "$INSTALL_TIMEOUT" "${INSTALL_CMD[@]}"
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name())"
"$PY" -c "import flash_attn.cute.interface as f; print('flash_attn.cute', f.__file__)" \
  || echo "flash_attn.cute: not importable (flash4 is skipped; the error above says why)"

echo "== goat-dist train on one GPU: NCCL smoke + resume, MFU of 125M and 1.3B"
part train "$TRAIN_TIMEOUT" "${TRAIN_CMD[@]}"

echo "== two GPUs: TP=2 over NCCL, an evaluation, a checkpoint-and-stop, a resume, eval ppl at DP=2"
part tp2 "$TP2_TIMEOUT" "${TP2_CMD[@]}"

echo "== tests/gpu"
export GOAT_TESTS_JSONL="$OUT_DIR/tests.jsonl"  # one line per test (tests/gpu/conftest.py)
part tests "$TESTS_TIMEOUT" "${TESTS_CMD[@]}" > >(tee "$OUT_DIR/tests.txt") 2>&1

echo "== GOAT vs plain attention TFLOP/s"
part bench "$BENCH_TIMEOUT" "${BENCH_CMD[@]}"
echo "== total $(( $(date +%s) - t0 )) s"
ok=0
for key in "${!RC[@]}"; do [[ ${RC[$key]} -ne 0 ]] && ok=1; done
exit $ok
