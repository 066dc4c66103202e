"""Sharded checkpoints of an FSDP2 model through ``torch.distributed.checkpoint`` (DCP), under the run
folder's checkpoint rules (:mod:`reprlab.runs.checkpoint`).

Layout: ``checkpoints/<tag>/step_00000100/`` holds

* ``.metadata`` and ``__<rank>_0.distcp``: DCP's files; every rank writes its own shards of the trainable
  parameters and of their optimizer state (tensors only: DCP stores other values as pickles, which reprlab
  does not load, so the optimizer's ``param_groups`` are taken from the live optimizer, whose settings come
  from the config)
* ``rng_rank<r>.safetensors`` + ``.json``: each rank's generator states (ranks draw different noise)
* ``<name>.safetensors`` / ``optim_<name>.*``: replicated parts (identical on every rank, written by rank 0:
  e.g. CRL+mining's latent attack), in the safe state format of :mod:`reprlab.runs.checkpoint`
* ``meta.json``: ``"kind": "dcp"``, step, ``extra``, world size, and the size and SHA-256 of every other file

The folder is assembled under a temporary name (the same on every rank) and renamed into place by rank 0
after every rank has written, so a killed run leaves the previous checkpoint or the new one, never a torn one.

Safety of DCP's metadata [ours]: torch 2.13's ``FileSystemReader.read_metadata`` reads ``.metadata`` with a
plain ``pickle.load`` (no ``weights_only``, no restricted unpickler); its tensor files are read with
``torch.load(weights_only=True)``. reprlab reads ``.metadata`` itself through a restricted unpickler
(:class:`SafeMetadataReader`) that resolves only DCP's metadata classes, ``torch.Size``, torch dtypes and
layouts and paths, so a planted pickle cannot run code. Before that, every rank checks every file against the
SHA-256 manifest in ``meta.json`` (written by reprlab, JSON): a checkpoint edited or damaged since it was
written is refused with the file named.
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from reprlab.errors import CheckpointError
from reprlab.runs import faults
from reprlab.runs.atomic import dumps_json, file_mode, read_json
from reprlab.runs.checkpoint import (
    FORMAT,
    TMP_PREFIX,
    _commit,
    _prune,
    _read_state,
    _Unloadable,
    _write_text,
    check_checkpoint,
    checkpoint_error,
    rng_state,
    set_rng_state,
    sha256_file,
    write_state,
)

KIND = "dcp"
METADATA = ".metadata"  # DCP's (pickled) metadata file: see the module docstring
_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)


def _group() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _rank() -> int:
    return dist.get_rank() if _group() else 0


def _barrier() -> None:
    if _group():
        dist.barrier()


def _tensor_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, list]:
    """``({"model": trainable parameters, "optim": the optimizer's per-parameter state}, param_groups)``; the
    optimizer state is created (a zero-lr step on zero gradients, DCP's own helper) when it does not exist yet."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_OPTIONS)
    for fqn, state in optim_sd["state"].items():
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"optimizer state {fqn}.{key} is a {type(value).__name__}, not a tensor")
    return {"model": model_sd, "optim": optim_sd["state"]}, optim_sd["param_groups"]


def save_sharded_checkpoint(
    root: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    replicated: dict[str, torch.nn.Module] | None = None,
    replicated_optims: dict[str, torch.optim.Optimizer] | None = None,
    extra: dict[str, Any] | None = None,
    meta: dict[str, Any] | None = None,
    keep_last: int = 2,
) -> Path:
    """Write one sharded checkpoint under ``root`` (the tag folder); a collective: every rank calls it.

    Returns the committed folder (on every rank).
    """
    final = root / f"step_{step:08d}"
    tmp = root / f"{TMP_PREFIX}{step:08d}_dcp"  # the same name on every rank
    rank = _rank()
    with faults.group("checkpoint"):
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # a killed save's leftovers
            tmp.mkdir()
        _barrier()
        state, _ = _tensor_state(model, optimizer)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp), sync_files=True))
        write_state(tmp, f"rng_rank{rank}", rng_state())
        if rank == 0:
            for name, module in (replicated or {}).items():
                write_state(tmp, name, dict(module.state_dict()))
            for name, opt in (replicated_optims or {}).items():
                write_state(tmp, f"optim_{name}", opt.state_dict())
        _barrier()
        if rank == 0:
            for f in tmp.iterdir():
                os.chmod(f, file_mode())
            files = {
                f.name: {"size": f.stat().st_size, "sha256": sha256_file(f)} for f in sorted(tmp.iterdir())
            }
            world = dist.get_world_size() if _group() else 1
            record = {"format": FORMAT, "kind": KIND, "world_size": world, "step": step, "extra": extra or {},
                      "files": files, **(meta or {})}  # fmt: skip
            _write_text(tmp / "meta.json", dumps_json(record) + "\n")
            os.chmod(tmp / "meta.json", file_mode())
            faults.file_op("commit", final, lambda: _commit(tmp, final))
            _prune(root, keep_last, None)
        _barrier()
    return final


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only what a DCP ``.metadata`` pickle names (listed from torch 2.13's writer)."""

    _MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
    _OTHERS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
               ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
               ("pathlib", "PureWindowsPath")}  # fmt: skip

    def find_class(self, module: str, name: str):
        import importlib

        if module in self._MODULES:
            obj = getattr(importlib.import_module(module), name, None)
            if isinstance(obj, type):  # dataclasses and enums only: no function of those modules is called
                return obj
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        elif (module, name) in self._OTHERS:
            return getattr(importlib.import_module(module), name)
        raise pickle.UnpicklingError(
            f"DCP metadata names {module}.{name}, which a checkpoint's metadata never does"
        )


class SafeMetadataReader(dcp.FileSystemReader):
    """DCP's file reader with ``.metadata`` read through :class:`_MetadataUnpickler` instead of ``pickle.load``."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def load_sharded_checkpoint(
    folder: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    replicated: dict[str, torch.nn.Module] | None = None,
    replicated_optims: dict[str, torch.optim.Optimizer] | None = None,
    restore_rng: bool = True,
) -> tuple[int, dict[str, Any]]:
    """Restore a :func:`save_sharded_checkpoint` folder into ``model`` and ``optimizer`` (a collective);
    returns ``(step, extra)``.

    Raises:
        CheckpointError: a file does not match the manifest (checked before DCP unpickles its metadata), the
            checkpoint is not a sharded one, or it was written by another number of ranks without this
            rank's RNG state.
    """
    problem = check_checkpoint(folder)
    if problem is not None:
        raise checkpoint_error(folder, problem)
    meta = read_json(folder / "meta.json")
    if meta.get("kind") != KIND:
        raise CheckpointError(f"{folder} is not a sharded (DCP) checkpoint: it was written without FSDP; "
                              "resume it without train sharding")  # fmt: skip
    rank = _rank()
    try:
        rng = _read_state(folder, f"rng_rank{rank}") if restore_rng else None
        rep = {name: _read_state(folder, name) for name in (replicated or {})}
        rep_opt = {name: _read_state(folder, f"optim_{name}") for name in (replicated_optims or {})}
    except _Unloadable as err:
        raise checkpoint_error(folder, err.problem) from None
    except FileNotFoundError as err:
        raise CheckpointError(f"{folder}: {err.filename} is missing (written by {meta.get('world_size')} "
                              "ranks?)") from None  # fmt: skip
    state, param_groups = _tensor_state(model, optimizer)
    reader = SafeMetadataReader(str(folder))
    try:  # read here first: inside dcp.load a refusal would surface as DCP's generic CheckpointException
        reader.read_metadata()
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"{folder / METADATA}: {err}; refusing the checkpoint") from None
    dcp.load(state, storage_reader=reader)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict={"state": state["optim"], "param_groups": param_groups},
        options=_OPTIONS,
    )
    for name, module in (replicated or {}).items():
        module.load_state_dict(rep[name])
    for name, opt in (replicated_optims or {}).items():
        opt.load_state_dict(rep_opt[name])
    if rng is not None:
        set_rng_state(rng)
    _barrier()
    return int(meta["step"]), meta.get("extra", {})
