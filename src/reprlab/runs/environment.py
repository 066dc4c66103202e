"""Where a run ran: devices (validated), versions, commit, CPU model, instruction sets and thread counts.

Bit-for-bit results are only promised on the same machine with the same thread counts: float reductions
are ordered differently by other BLAS kernels (AVX2 vs AVX-512), other thread counts and other devices, so
``env.json`` records all of them to tell two runs' conditions apart.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from reprlab.errors import DeviceError

# The instruction-set flags that change which float kernels (and so which rounding) BLAS/oneDNN pick.
_ISA_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "avx512f",
    "avx512_bf16",
    "avx512_vnni",
    "amx_tile",
    "asimd",
    "sve",
)


def resolve_device(name: str | None) -> torch.device:
    """``auto`` → CUDA when present else CPU; anything else must name a device this machine has.

    Raises:
        DeviceError: an unknown device string (``gpu``), or CUDA/MPS asked for where there is none.
    """
    if name in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise DeviceError(
            f"device={name!r} is not a device name", hint="use auto, cpu, cuda or cuda:N (and mps on a Mac)"
        ) from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(
                f"device={name!r} but this machine has no CUDA device", hint="use device=cpu or auto"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise DeviceError(f"device={name!r} but only {torch.cuda.device_count()} CUDA device(s) exist")
    elif dev.type == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise DeviceError(f"device={name!r} but MPS is not available here", hint="use device=cpu or auto")
    elif dev.type != "cpu":
        raise DeviceError(f"device={name!r} is not supported", hint="use auto, cpu, cuda or cuda:N")
    return dev


def git_sha() -> str | None:
    try:
        here = Path(__file__).resolve().parent
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("reprlab", "torch", "transformers", "peft", "numpy", "scikit-learn", "pot", "gensim"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def cpu_record() -> dict[str, Any]:
    """CPU model, the ISA flags that pick float kernels, and every thread count that changes reductions."""
    model, flags = platform.processor() or None, set()
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        m = re.search(r"^(?:model name|Model|CPU part)\s*:\s*(.+)$", text, re.M)
        model = m.group(1).strip() if m else model
        fm = re.search(r"^(?:flags|Features)\s*:\s*(.+)$", text, re.M)
        flags = set(fm.group(1).split()) if fm else set()
    except OSError:
        pass
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = os.cpu_count()
    return {
        "cpu_model": model,
        "machine": platform.machine(),
        "isa_flags": sorted(f for f in _ISA_FLAGS if f in flags),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "torch_cpu_capability": getattr(torch.backends.cpu, "get_cpu_capability", lambda: None)(),
        "thread_env": {
            k: os.environ[k]
            for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OPENBLAS_CORETYPE")
            if k in os.environ
        },  # fmt: skip
    }


def environment_record(cfg: Any, recipe: str, device: torch.device, argv: list[str] | None) -> dict[str, Any]:
    rec = {
        "recipe": recipe, "seed": getattr(cfg, "seed", None), "device": str(device), "git_commit": git_sha(),
        "versions": versions(), "platform": platform.platform(), "command": argv if argv is not None else sys.argv,
        "invocation": list(sys.argv),  # as typed: "command" is the recipe and every override it resolved to
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cuda": torch.cuda.is_available(), "cwd": os.getcwd(),
        "world_size": int(os.environ.get("WORLD_SIZE", "1")), **cpu_record(),
    }  # fmt: skip
    rec["cpu_threads"] = rec["torch_threads"]  # the key older run folders used
    if torch.cuda.is_available():
        rec["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        rec["cuda_version"] = torch.version.cuda
    return rec
