#!/usr/bin/env bash
# Build (once) the side virtual environment in which reprlab's open_clip path runs.
#
# Why a side venv: open-clip-torch needs torchvision, and no torchvision wheel imports beside the
# project's pinned torch 2.13.0 CPU build ("operator torchvision::nms does not exist"). On x86_64
# with Python 3.11, torch 2.14.1 + torchvision 0.29.1 import together (a CUDA build that runs on the
# CPU, ~5.5 GB; ~6 GB with open_clip and reprlab's dependencies). Override with OPENCLIP_TORCH /
# OPENCLIP_TORCHVISION (a matching pair). The project itself is installed --no-deps (editable), its other dependencies beside
# it, with torch held at the side version by a constraints file.
#
# Usage:  scripts/openclip_env.sh [VENV_DIR]          (default: $OPENCLIP_VENV or .venv-openclip)
# Then:   VENV_DIR/bin/python -m pytest tests/methods/otcclip/test_openclip.py -q
#         VENV_DIR/bin/reprlab run otcclip-openclip-tiny --demo
# Idempotent: an existing venv in which open_clip, torchvision and reprlab import is left as it is.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-${OPENCLIP_VENV:-$ROOT/.venv-openclip}}"
PY="${PYTHON:-python3.11}"
# x86_64: a CUDA build of torch 2.14.1 that runs on the CPU (~5.5 GB); aarch64: a CPU build of 2.9.1 (~0.7 GB)
case "$(uname -m)" in
  aarch64 | arm64) DEF_TORCH=2.9.1 DEF_TV=0.24.1 ;;
  *) DEF_TORCH=2.14.1 DEF_TV=0.29.1 ;;
esac
TORCH_VER="${OPENCLIP_TORCH:-$DEF_TORCH}"
TV_VER="${OPENCLIP_TORCHVISION:-$DEF_TV}"

check() {
  "$VENV/bin/python" - <<'PY' 2>/dev/null
import torch, torchvision, open_clip, reprlab.methods.otcclip.models.openclip  # noqa: F401
torchvision.ops.nms  # the op that fails when torch and torchvision do not match
PY
}

if [ -x "$VENV/bin/python" ] && check; then
  echo "openclip venv ready: $VENV"
  exit 0
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check)
CONS="$VENV/reprlab-openclip-constraints.txt"
printf 'torch==%s\ntorchvision==%s\n' "$TORCH_VER" "$TV_VER" >"$CONS"

"${PIP[@]}" -c "$CONS" "torch==$TORCH_VER" "torchvision==$TV_VER"
"${PIP[@]}" -c "$CONS" open-clip-torch
# reprlab's runtime dependencies (pyproject.toml [project].dependencies) but torch, plus the test and
# shard tools; torch stays at the side version (constraints file).
"${PIP[@]}" -c "$CONS" "numpy>=1.26" "scipy>=1.11" "scikit-learn>=1.4" "pyyaml>=6" "typer>=0.12" \
  "rich>=13" "matplotlib>=3.8" "safetensors>=0.4" "transformers>=5.0" "accelerate>=1.0" "gguf>=0.10" \
  "peft>=0.17" "pillow>=10" "webdataset==1.0.2" "pytest>=8" "hypothesis>=6"
"${PIP[@]}" -c "$CONS" --no-deps -e "$ROOT"

if check; then
  echo "openclip venv ready: $VENV"
else
  echo "openclip venv built at $VENV but open_clip/torchvision/reprlab do not import together" >&2
  "$VENV/bin/python" -c "import torch, torchvision, open_clip; torchvision.ops.nms" || true
  exit 1
fi
