#!/usr/bin/env bash
# The prepared GPU check (benchmarks/gpu_check.py) on a machine with one or more CUDA GPUs: about
# 5 minutes, one summary table; `--kernels` alone about a minute. Needs no network.
#
#   bash scripts/gpu-check.sh [OUT_DIR] [gpu_check.py options, e.g. --kernels]
#   bash scripts/gpu-check.sh /tmp/rehearsal --smoke   # the same script on CPU, ~1-2 minutes
#
# torch: the machine's own CUDA build, never one from the package index (a wheel built with
# CUDA < 12.9 turns the blockwise FP8 kernel off). By default the check runs in the interpreter
# $PYTHON (python3) when it imports torch, with dstrain from this checkout (PYTHONPATH). Set
# TORCH to test another build: its words go to `pip install` in .venv-gpu, a venv made with
# --system-site-packages (the machine's other packages stay visible), e.g.
#   TORCH=/wheels/torch-2.9.1+cu129-cp311-cp311-linux_x86_64.whl bash scripts/gpu-check.sh
#   TORCH="torch==2.9.1 --index-url https://download.pytorch.org/whl/cu129" bash scripts/...
# dstrain's other dependencies come from that interpreter; where some are missing it tries
# `pip install -e .` into .venv-gpu (the package index or a local mirror), else says which.
#
# Exit status: gpu_check.py's (0 all rows ok or skipped, 1 a row failed, 2 no GPU visible), or
# 3 when no usable torch was found. The end of the output lists the rows that were skipped:
# those proved nothing on this machine.
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$(pwd)"
out="${1:-gpu-check}"
shift $(($# > 0 ? 1 : 0))
python="${PYTHON:-python3}"
deps="torch pydantic rich yaml numpy tomli_w tokenizers"  # what `dstrain train` imports
smoke=$([[ " $* " == *" --smoke "* ]] && echo 1 || echo 0)  # the CPU rehearsal: no GPU needed
command -v "$python" >/dev/null || { echo "gpu-check: no $python here (set PYTHON)" >&2; exit 3; }

missing() {  # the modules of $deps that interpreter $1 cannot import
  "$1" - "$deps" <<'EOF'
import importlib.util, sys
print(" ".join(m for m in sys.argv[1].split() if importlib.util.find_spec(m) is None))
EOF
}

venv() {  # .venv-gpu over the machine's site-packages; echo its python
  [ -x .venv-gpu/bin/python ] || "$python" -m venv --system-site-packages .venv-gpu >&2
  echo .venv-gpu/bin/python
}

if [ -n "${TORCH:-}" ]; then
  python="$(venv)"
  echo "gpu-check: installing TORCH=$TORCH into .venv-gpu"
  # shellcheck disable=SC2086  # TORCH holds pip words: a wheel path or a spec with options
  "$python" -m pip install -q $TORCH
fi
lacking="$(missing "$python")"
if [ -n "$lacking" ] && [[ " $lacking " != *" torch "* ]]; then
  # torch is here, others are not: the index (or a mirror) may have them; torch stays pinned.
  installed="$("$python" -c 'import torch; print(torch.__version__)')"
  python="$(venv)"
  echo "gpu-check: lacking $lacking; pip install -e . (torch==$installed kept)"
  "$python" -m pip install -q --no-build-isolation -e . "torch==$installed" || true
  lacking="$(missing "$python")"
fi
if [ -n "$lacking" ]; then
  echo "gpu-check: $python cannot import: $lacking" >&2
  echo "  torch: install the machine's CUDA build, or set TORCH=/path/to/wheel or a pip spec;" >&2
  echo "  the others: pip install -e . where a package index (or a mirror) is reachable" >&2
  exit 3
fi
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
if ! "$python" - "$smoke" <<'EOF'
import sys, torch
print(f"gpu-check: {sys.executable}: torch {torch.__version__} from {torch.__file__}")
print(f"gpu-check: built with CUDA {torch.version.cuda or 'none (a CPU build)'}; "
      f"{torch.cuda.device_count()} GPU(s) visible")
sys.exit(0 if sys.argv[1] == "1" or torch.version.cuda and torch.cuda.is_available() else 1)
EOF
then
  echo "gpu-check: no CUDA GPU for this torch (a CPU build: set TORCH; else see nvidia-smi)" >&2
  exit 3
fi
status=0
"$python" benchmarks/gpu_check.py --out "$out" "$@" || status=$?
skipped="$("$python" -c 'import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
print(sum(r["verdict"] == "skip" for r in rows))' "$out/gpu_check.json" 2>/dev/null || echo "?")"
verdict=$([ "$status" = 0 ] && echo "PASSED" || echo "FAILED (exit $status)")
echo "gpu-check: $verdict; $skipped row(s) skipped (listed above: they did not run here and" \
  "prove nothing); the table is in $out/gpu_check.json"
exit "$status"
