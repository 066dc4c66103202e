"""Checkpoints: safetensors weights, optimizer state and every RNG state, written atomically.

Layout: ``checkpoints/<tag>/step_00000100/{<module>.safetensors, optim_<name>.pt, rng.pt, meta.json}``.
A checkpoint folder is assembled under a temporary name and renamed into place, so an interrupted save
leaves either the previous checkpoint or the new one, never a torn one.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from reprlab.runs.atomic import atomic_write_json, dir_mode, file_mode, read_json


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _state_for_safetensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    # safetensors refuses shared storage (tied embeddings): store contiguous clones, load with strict=False
    # semantics handled by load_state_dict below.
    return {k: v.detach().contiguous().clone().cpu() for k, v in module.state_dict().items()}


def save_checkpoint_dir(
    root: Path,
    step: int,
    modules: dict[str, torch.nn.Module],
    optimizers: dict[str, torch.optim.Optimizer] | None = None,
    extra: dict[str, Any] | None = None,
    meta: dict[str, Any] | None = None,
    keep_last: int = 2,
    keep_every: int | None = None,
) -> Path:
    """Write one checkpoint under ``root`` (the tag folder) and prune old ones. Returns its folder."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".tmp_step_"))
    os.chmod(tmp, dir_mode())
    try:
        for name, module in modules.items():
            save_file(_state_for_safetensors(module), str(tmp / f"{name}.safetensors"))
        for name, opt in (optimizers or {}).items():
            torch.save(opt.state_dict(), tmp / f"optim_{name}.pt")
        torch.save(rng_state(), tmp / "rng.pt")
        for f in tmp.iterdir():
            os.chmod(f, file_mode())
        # the manifest lets a resume tell a torn or bit-rotted checkpoint from an intact one
        files = {f.name: {"size": f.stat().st_size, "crc32": _crc32(f)} for f in sorted(tmp.iterdir())}
        atomic_write_json(
            tmp / "meta.json", {"step": step, "extra": extra or {}, "files": files, **(meta or {})}
        )
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(root)[:-keep_last] if keep_last > 0 else []:
        step_of_old = int(old.name.split("_")[1])
        if keep_every and step_of_old % keep_every == 0:
            continue
        shutil.rmtree(old, ignore_errors=True)
    return final


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def verify_checkpoint(folder: Path) -> str | None:
    """``None`` if the checkpoint is intact, else why not (missing file, wrong size or checksum, bad meta).

    Checkpoints written before the manifest existed are only checked for a readable ``meta.json``.
    """
    try:
        meta = read_json(folder / "meta.json")
    except (FileNotFoundError, ValueError, UnicodeDecodeError) as err:
        return f"meta.json unreadable ({err})"
    for name, info in (meta.get("files") or {}).items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != info["size"]:
            return f"{name} has {path.stat().st_size} bytes, expected {info['size']}"
        if _crc32(path) != info["crc32"]:
            return f"{name} fails its checksum"
    return None


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoint folders under a tag folder, oldest first."""
    if not root.exists():
        return []
    dirs = [
        d for d in root.iterdir() if d.is_dir() and d.name.startswith("step_") and (d / "meta.json").exists()
    ]
    return sorted(dirs, key=lambda d: int(d.name.split("_")[1]))


def load_checkpoint_dir(
    folder: Path,
    modules: dict[str, torch.nn.Module],
    optimizers: dict[str, torch.optim.Optimizer] | None = None,
    restore_rng: bool = True,
) -> tuple[int, dict[str, Any]]:
    """Restore modules, optimizers and RNG from a checkpoint folder; returns ``(step, extra)``."""
    meta = read_json(folder / "meta.json")
    for name, module in modules.items():
        path = folder / f"{name}.safetensors"
        if not path.exists():
            raise FileNotFoundError(f"checkpoint {folder} has no weights for module {name!r} ({path.name})")
        try:
            state = load_file(str(path))
        except Exception as err:  # safetensors raises its own error types on corrupt files
            raise ValueError(f"checkpoint file {path} is corrupt: {err}") from err
        module.load_state_dict(state)
    for name, opt in (optimizers or {}).items():
        path = folder / f"optim_{name}.pt"
        if not path.exists():
            raise FileNotFoundError(f"checkpoint {folder} has no optimizer state {path.name}")
        opt.load_state_dict(torch.load(path, weights_only=False))
    if restore_rng:
        set_rng_state(torch.load(folder / "rng.pt", weights_only=False))
    return int(meta["step"]), meta.get("extra", {})
