#!/usr/bin/env bash
# The prepared GPU check (benchmarks/gpu_check.py): on a machine with one or more CUDA GPUs,
# about 5 minutes, one summary table. Installs dstrain into a venv with the machine's own CUDA
# build of torch (no constraints file: that pins the CPU wheel), then runs the check.
#   bash scripts/gpu-check.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu-check}"
if [ ! -x .venv-gpu/bin/python ]; then
  python3 -m venv .venv-gpu
  .venv-gpu/bin/pip install -q -e .
fi
.venv-gpu/bin/python benchmarks/gpu_check.py --out "$out"
