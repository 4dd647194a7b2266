#!/usr/bin/env bash
# The GPU check, in one command on one CUDA machine (sized for 8 minutes on one H200, cold cache):
#   0. installs the `gpu` extra (FlashAttention-4 and its dependencies) from wheels only, never an sdist
#      (GOAT_SKIP_INSTALL=1 skips it where the environment is prepared already);
#   1. bench/gpu_train.py: an NCCL smoke run of `goat-dist train` (bf16, checkpoint at step 10, resume to
#      30) and the end-to-end MFU of the 125M and 1.3B configs;
#   2. tests/gpu (bf16 parity of flash4 / FA2 / sdpa for GOAT up to L=16k, the flash4 log-sum-exp, the
#      bf16 long-sequence error against float64);
#   3. bench/gpu_attention.py: GOAT against plain attention in the same kernel (flash4, FA2, sdpa),
#      forward + backward TFLOP/s at head dims 64 and 128, L = 2k to 32k.
#
#   bash bench/gpu_suite.sh [OUT_DIR]        # default runs/gpu_suite; $OUT is used when set
#
# goat-dist itself must already be importable (launch/setup.sh, or PYTHONPATH). Without network access,
# download the wheels elsewhere first and point GOAT_WHEELHOUSE at them:
#   pip download --only-binary=:all: -d wheelhouse 'flash-attn-4>=4.0.0b36'   (same Python / platform)
# Writes gpu_train.json, tests.txt, gpu_attention.{json,md} and suite.json (timings, exit codes) to
# OUT_DIR; docs/performance.md keeps the figures of each run on a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-runs/gpu_suite}}
mkdir -p "$OUT_DIR"
export DS_ACCELERATOR=cuda PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
t0=$(date +%s)

install_rc=0
if [[ -z "${GOAT_SKIP_INSTALL:-}" ]]; then
  mapfile -t REQS < <("$PY" - <<'PY'
import re
try:
    import tomllib
    extra = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["gpu"]
except ModuleNotFoundError:  # Python 3.10: the one-line list in pyproject.toml
    line = next(l for l in open("pyproject.toml") if l.startswith("gpu = ["))
    extra = re.findall(r'"([^"]+)"', line)
print("\n".join(extra))
PY
  )
  PIP_ARGS=(--only-binary=:all:)
  if [[ -n "${GOAT_WHEELHOUSE:-}" ]]; then PIP_ARGS+=(--no-index --find-links "$GOAT_WHEELHOUSE"); fi
  echo "== installing the gpu extra from wheels: ${REQS[*]}"
  "$PY" -m pip install -q "${PIP_ARGS[@]}" "${REQS[@]}"
  install_rc=$?
fi
t1=$(date +%s)
echo "== install: exit $install_rc, $((t1 - t0)) s"
"$PY" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
"$PY" -c "import flash_attn.cute as f; print('flash_attn.cute', f.__file__)" || echo "flash_attn.cute: not importable"

echo "== goat-dist train on one GPU: NCCL smoke + resume, MFU of 125M and 1.3B"
timeout "${GOAT_TRAIN_TIMEOUT:-250}" "$PY" bench/gpu_train.py --out "$OUT_DIR"
train_rc=$?
t2=$(date +%s)
echo "== train: exit $train_rc, $((t2 - t1)) s"

echo "== tests/gpu"
timeout "${GOAT_TESTS_TIMEOUT:-140}" "$PY" -m pytest tests/gpu -q -rs -p no:cacheprovider 2>&1 | tee "$OUT_DIR/tests.txt"
tests_rc=${PIPESTATUS[0]}
t3=$(date +%s)
echo "== tests/gpu: exit $tests_rc, $((t3 - t2)) s"

echo "== GOAT vs plain attention TFLOP/s"
# shellcheck disable=SC2086  # GOAT_ATTENTION_ARGS is a list of flags
timeout "${GOAT_BENCH_TIMEOUT:-140}" "$PY" bench/gpu_attention.py --out "$OUT_DIR" ${GOAT_ATTENTION_ARGS:-}
bench_rc=$?
t4=$(date +%s)
echo "== bench: exit $bench_rc, $((t4 - t3)) s; total $((t4 - t0)) s"
cat > "$OUT_DIR/suite.json" <<JSON
{"install_s": $((t1 - t0)), "train_s": $((t2 - t1)), "tests_s": $((t3 - t2)), "bench_s": $((t4 - t3)),
 "total_s": $((t4 - t0)), "install_rc": $install_rc, "train_rc": $train_rc, "tests_rc": $tests_rc,
 "bench_rc": $bench_rc}
JSON
[[ $install_rc -eq 0 && $train_rc -eq 0 && $tests_rc -eq 0 && $bench_rc -eq 0 ]]
