#!/usr/bin/env bash
# One-GPU check (about 3-8 minutes on one CUDA GPU): bench_ot.py --device cuda (ours vs POT's torch backend),
# an otcclip-mosaic-tiny epoch, Rote training steps and `reprlab run crl-tiny --demo` in bf16, printed as one table
# with each part's time and peak CUDA memory (scripts/gpu_check.py). Refuses to start without CUDA, and fails
# when a part did not allocate CUDA memory.
#
# Usage:  scripts/gpu_check.sh [--parts ot,otcclip,rote,crl]      (PYTHON=... to choose the interpreter)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python}"
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: FAILED: CUDA is not available to $PY (torch $("$PY" -c 'import torch; print(torch.__version__, "CUDA build:", torch.version.cuda)' 2>/dev/null || echo 'not importable')); this check needs one CUDA GPU" >&2
    exit 2
fi
export HF_HUB_OFFLINE=1
# 8 minutes at most: a hung part must not hold the GPU
exec timeout 480 "$PY" "$ROOT/scripts/gpu_check.py" --device cuda "$@"
