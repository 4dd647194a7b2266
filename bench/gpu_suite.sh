#!/usr/bin/env bash
# The GPU check, in one command on one CUDA machine (sized for 8 minutes on one H200, cold cache):
#   1. installs the `gpu` extra (FlashAttention-4 and its dependencies) from wheels only, never an sdist;
#   2. runs tests/gpu (bf16 parity of flash4 / FA2 / sdpa for GOAT up to L=16k, the flash4 log-sum-exp,
#      the bf16 long-sequence error against float64);
#   3. times flash4 vs sdpa (and FA2 when installed) for GOAT at L=4k and 16k (bench/gpu_attention.py).
#
#   bash bench/gpu_suite.sh [OUT_DIR]        # default runs/gpu_suite; $OUT is used when set
#
# goat-dist itself must already be installed in the active environment (launch/setup.sh). Without network
# access, download the wheels elsewhere first and point GOAT_WHEELHOUSE at them:
#   pip download --only-binary=:all: -d wheelhouse 'flash-attn-4>=4.0.0b36'   (same Python / platform)
# Writes tests.txt, gpu_attention.json, gpu_attention.md and suite.json (timings, exit codes) to OUT_DIR.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-runs/gpu_suite}}
mkdir -p "$OUT_DIR"
t0=$(date +%s)

mapfile -t REQS < <(python - <<'EOF'
import re
try:
    import tomllib
    extra = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["gpu"]
except ModuleNotFoundError:  # Python 3.10: the one-line list in pyproject.toml
    line = next(l for l in open("pyproject.toml") if l.startswith("gpu = ["))
    extra = re.findall(r'"([^"]+)"', line)
print("\n".join(extra))
EOF
)
PIP_ARGS=(--only-binary=:all:)
if [[ -n "${GOAT_WHEELHOUSE:-}" ]]; then PIP_ARGS+=(--no-index --find-links "$GOAT_WHEELHOUSE"); fi
echo "== installing the gpu extra from wheels: ${REQS[*]}"
python -m pip install -q "${PIP_ARGS[@]}" "${REQS[@]}"
install_rc=$?
t1=$(date +%s)
echo "== install: exit $install_rc, $((t1 - t0)) s"
python -c "import flash_attn.cute, torch; print('flash_attn.cute', flash_attn.cute.__file__, '| torch', torch.__version__, torch.cuda.get_device_name())"

echo "== tests/gpu"
timeout 330 python -m pytest tests/gpu -q -rs -p no:cacheprovider 2>&1 | tee "$OUT_DIR/tests.txt"
tests_rc=${PIPESTATUS[0]}
t2=$(date +%s)
echo "== tests/gpu: exit $tests_rc, $((t2 - t1)) s"

echo "== flash4 vs sdpa TFLOP/s"
timeout 150 python bench/gpu_attention.py --out "$OUT_DIR"
bench_rc=$?
t3=$(date +%s)
echo "== bench: exit $bench_rc, $((t3 - t2)) s; total $((t3 - t0)) s"
cat > "$OUT_DIR/suite.json" <<EOF
{"install_s": $((t1 - t0)), "tests_s": $((t2 - t1)), "bench_s": $((t3 - t2)), "total_s": $((t3 - t0)),
 "install_rc": $install_rc, "tests_rc": $tests_rc, "bench_rc": $bench_rc}
EOF
[[ $install_rc -eq 0 && $tests_rc -eq 0 && $bench_rc -eq 0 ]]
