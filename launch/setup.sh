#!/usr/bin/env bash
# Install goat-dist and its test tools into the active Python environment.
# Order matters: torch first (the CPU wheel on CPU machines), so nothing later resolves a CUDA torch;
# DeepSpeed without build isolation and without ops, so its build neither fetches torch nor compiles.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION="${GOAT_TORCH_VERSION:-2.13.0}"
python -m pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q "torch==${TORCH_VERSION}"
fi
# the installed torch, pinned for every later install: nothing below may replace it (by a CUDA build, say)
torch_pin="$(mktemp)"
trap 'rm -f "$torch_pin"' EXIT
python -c "import torch; print('torch==' + torch.__version__)" > "$torch_pin"
python -m pip install -q -c "$torch_pin" numpy psutil wheel setuptools
DS_BUILD_OPS=0 python -m pip install -q -c "$torch_pin" --no-build-isolation "deepspeed>=0.19.8,<0.20"
python -m pip install -q -c "$torch_pin" --no-build-isolation -e ".[test]"
python -c "import torch, deepspeed, megatron.core, webdataset, goat_dist; print('goat-dist ready: torch', torch.__version__)"
