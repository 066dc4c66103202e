"""Checkpoints: weights, optimizer state and every RNG state as safetensors + JSON, written atomically.

Layout: ``checkpoints/<tag>/step_00000100/`` holds

* ``<module>.safetensors``: each module's ``state_dict()``
* ``optim_<name>.safetensors`` + ``optim_<name>.json``: an optimizer's tensors and the rest of its state
* ``rng.safetensors`` + ``rng.json``: torch's CPU and CUDA generator states; Python's and numpy's states
* ``meta.json``: step, ``extra``, and the size and SHA-256 of every other file (written last)

Nothing is pickled, so loading a checkpoint someone handed you cannot run code (see
:mod:`reprlab.runs.statefile`). A checkpoint folder is assembled under a temporary name and renamed into
place, so an interrupted save leaves either the previous checkpoint or the new one, never a torn one.

Loading is all or nothing: every file is checked against ``meta.json`` and parsed, and every part is
checked against the modules, optimizers and generators it will go into, before anything is applied. A
checkpoint that fails raises :class:`reprlab.errors.CheckpointError` naming the file and the previous intact
checkpoint; it is never skipped silently. Checkpoints of older reprlab versions (``optim_*.pt`` and
``rng.pt``, which are pickles) are refused with the command that converts them
(:mod:`reprlab.runs.convert`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from reprlab.errors import CheckpointError, WriteError
from reprlab.runs import faults, statefile
from reprlab.runs.atomic import dir_mode, dumps_json, file_mode, fsync_dir, read_json, write_error

log = logging.getLogger(__name__)

FORMAT = 2  # 1: optimizer and RNG state pickled with torch.save, CRC32 in meta.json
TRASH_PREFIX = ".trash-"
TMP_PREFIX = ".tmp_step_"


# ---------------------------------------------------------------------------------------------- RNG state
def rng_state() -> dict[str, Any]:
    """Python's, numpy's and torch's (CPU and every CUDA device's) generator states."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(legacy=False),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _check_rng_state(state: Any) -> None:
    """Raise ``ValueError`` unless ``state`` would be accepted by :func:`set_rng_state` (tried on spares)."""
    if not isinstance(state, dict) or not {"python", "numpy", "torch"} <= set(state):
        raise ValueError("the RNG state needs python, numpy and torch entries")
    try:
        random.Random().setstate(state["python"])
        np.random.RandomState().set_state(state["numpy"])
        torch.Generator().set_state(state["torch"])
    except (TypeError, ValueError, KeyError, RuntimeError) as err:
        raise ValueError(f"the RNG state does not fit this Python, numpy or torch ({err})") from None
    cuda = state.get("cuda", [])
    if not isinstance(cuda, list) or not all(
        isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1 for t in cuda
    ):
        raise ValueError("the CUDA RNG states must be a list of uint8 tensors")


# ---------------------------------------------------------------------------------------------- saving
def _state_for_safetensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    # safetensors refuses shared storage (tied embeddings): store contiguous clones
    return {k: v.detach().contiguous().clone().cpu() for k, v in module.state_dict().items()}


def _write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, str(path))
    _fsync_file(path)


def _write_text(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as fh:
        os.fsync(fh.fileno())


def write_state(folder: Path, stem: str, tree: Any) -> None:
    """``<stem>.safetensors`` (the tensors) and ``<stem>.json`` (the rest) of a state tree."""
    skeleton, tensors = statefile.encode(tree)
    faults.file_op(
        "write", f"{stem}.safetensors", lambda: _write_tensors(folder / f"{stem}.safetensors", tensors)
    )
    faults.file_op(
        "write", f"{stem}.json", lambda: _write_text(folder / f"{stem}.json", statefile.dumps(skeleton))
    )


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
    """Write one checkpoint under ``root`` (the tag folder) and prune old ones. Returns its folder.

    Raises:
        WriteError: the checkpoint cannot be written (full disk, read-only folder); the previous
            checkpoints are untouched and no temporary folder is left behind.
    """
    final = root / f"step_{step:08d}"
    tmp: Path | None = None
    with faults.group("checkpoint"):
        try:
            root.mkdir(parents=True, exist_ok=True)
            tmp = faults.file_op("mkdir", final, lambda: Path(tempfile.mkdtemp(dir=root, prefix=TMP_PREFIX)))
            os.chmod(tmp, dir_mode())
            for name, module in modules.items():
                path = tmp / f"{name}.safetensors"
                state = _state_for_safetensors(module)
                faults.file_op("write", path, lambda p=path, s=state: _write_tensors(p, s))
            for name, opt in (optimizers or {}).items():
                write_state(tmp, f"optim_{name}", opt.state_dict())
            write_state(tmp, "rng", rng_state())
            for f in tmp.iterdir():
                os.chmod(f, file_mode())
            # the manifest lets a resume tell a torn, bit-rotted or edited checkpoint from an intact one
            files = {
                f.name: {"size": f.stat().st_size, "sha256": sha256_file(f)} for f in sorted(tmp.iterdir())
            }
            record = {"format": FORMAT, "step": step, "extra": extra or {}, "files": files, **(meta or {})}
            text = dumps_json(record) + "\n"
            faults.file_op("write", "meta.json", lambda: _write_text(tmp / "meta.json", text))
            os.chmod(tmp / "meta.json", file_mode())
            faults.file_op("commit", final, lambda: _commit(tmp, final))
            tmp = None
        except OSError as err:
            previous = list_checkpoints(root)
            kept = f"; the previous checkpoint {previous[-1]} is intact" if previous else ""
            error = write_error(err, final, "checkpoint")
            raise WriteError(f"{error}{kept}", hint=error.hint) from err
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        _prune(root, keep_last, keep_every)
    return final


def _commit(tmp: Path, final: Path) -> None:
    """Rename the finished folder into place; an existing folder of the same step is replaced, never mixed."""
    fsync_dir(tmp)
    old = None
    if final.exists():
        old = final.with_name(f"{TRASH_PREFIX}{final.name}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _prune(root: Path, keep_last: int, keep_every: int | None) -> None:
    """Drop old checkpoints (renamed out of the listing first, so a kill never leaves a half-deleted one)."""
    if keep_last <= 0:
        return
    for old in list_checkpoints(root)[:-keep_last]:
        if keep_every and step_of(old) % keep_every == 0:
            continue
        trash = old.with_name(f"{TRASH_PREFIX}{old.name}")
        try:
            faults.file_op("discard", old, lambda o=old, t=trash: os.replace(o, t))
            faults.file_op("remove", trash, lambda t=trash: shutil.rmtree(t))
        except OSError as err:  # the new checkpoint is in place; an old one left over costs only space
            log.warning("could not remove the old checkpoint %s (%s); it can be deleted by hand", old, err)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def step_of(folder: Path) -> int:
    return int(folder.name.split("_")[1])


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoint folders under a tag folder, oldest first."""
    if not root.exists():
        return []
    dirs = [
        d
        for d in root.iterdir()
        if d.is_dir() and d.name.startswith("step_") and d.name[5:].isdigit() and (d / "meta.json").exists()
    ]
    return sorted(dirs, key=step_of)


# ---------------------------------------------------------------------------------------------- checking
@dataclass(frozen=True)
class Problem:
    """Why a checkpoint cannot be used. ``legacy``: written by an older reprlab (pickles), convertible."""

    file: str
    why: str
    legacy: bool = False


def legacy_files(folder: Path) -> list[str]:
    """Pickled parts of a checkpoint written before the safetensors + JSON format."""
    return sorted(p.name for p in folder.glob("*.pt"))


def check_checkpoint(folder: Path, parse: bool = False) -> Problem | None:
    """``None`` if every file matches ``meta.json`` (size and SHA-256), else the first problem found.

    With ``parse``, every part is also parsed (safetensors headers, JSON state files, the RNG state tried on
    spare generators), so a checkpoint that passes will load into modules and optimizers of the same config.
    A legacy checkpoint is reported as such, and no file of it is opened beyond ``meta.json``.
    """
    try:
        meta = read_json(folder / "meta.json")
    except (FileNotFoundError, ValueError, OSError) as err:
        return Problem("meta.json", f"unreadable ({err})")
    if not isinstance(meta, dict) or not isinstance(meta.get("files"), dict):
        return Problem("meta.json", "has no file manifest")
    pickles = legacy_files(folder)
    if meta.get("format") != FORMAT or pickles:
        what = ", ".join(pickles) or "its files"
        return Problem(pickles[0] if pickles else "meta.json",
                       f"was written in the old checkpoint format ({what}: Python pickles, which reprlab "
                       "no longer loads because unpickling a file can run code)", legacy=True)  # fmt: skip
    for name, info in meta["files"].items():
        path = folder / name
        # a sharded (DCP) checkpoint also holds DCP's ".metadata" (reprlab.runs.dcp)
        dcp_metadata = meta.get("kind") == "dcp" and name == ".metadata"
        if not isinstance(info, dict) or "/" in name or (name.startswith(".") and not dcp_metadata):
            return Problem("meta.json", f"has a malformed entry for {name!r}")
        if not path.is_file():
            return Problem(name, "is missing")
        size = path.stat().st_size
        if size != info.get("size"):
            return Problem(name, f"has {size} bytes, meta.json says {info.get('size')}")
        if sha256_file(path) != info.get("sha256"):
            return Problem(name, "does not match its SHA-256 in meta.json")
    return _parse_problem(folder, meta["files"]) if parse else None


def _parse_problem(folder: Path, files: dict[str, Any]) -> Problem | None:
    from safetensors import safe_open

    keys: dict[str, set[str]] = {}
    for name in files:
        if name.endswith(".safetensors"):
            try:
                with safe_open(str(folder / name), framework="pt") as fh:
                    keys[name[: -len(".safetensors")]] = set(fh.keys())
            except Exception as err:  # safetensors' own error types
                return Problem(name, f"is not a valid safetensors file ({err})")
    for name in files:
        stem = name[: -len(".json")]
        if name.endswith(".json") and name != "meta.json":
            try:
                if stem == "rng":
                    _check_rng_state(_read_state(folder, stem))
                else:
                    skeleton = statefile.loads((folder / name).read_text(encoding="utf-8"), name)
                    statefile.decode(skeleton, dict.fromkeys(keys.get(stem, ())))
            except _Unloadable as err:
                return err.problem
            except (statefile.StateFormatError, ValueError, OSError) as err:
                return Problem(name, f"is not a reprlab state file ({err})")
    return None


def verify_checkpoint(folder: Path) -> str | None:
    """``None`` if the checkpoint is intact, else why not (``<file> <reason>``)."""
    problem = check_checkpoint(folder)
    return None if problem is None else f"{problem.file} {problem.why}"


def previous_intact(folder: Path) -> Path | None:
    """The newest intact checkpoint of the same tag older than ``folder``."""
    for ckpt in reversed(list_checkpoints(folder.parent)):
        if step_of(ckpt) < step_of(folder) and check_checkpoint(ckpt, parse=True) is None:
            return ckpt
    return None


def run_dir_of(folder: Path) -> Path:
    """``<run>/checkpoints/<tag>/step_N`` -> ``<run>``."""
    return folder.parent.parent.parent


def resume_name(folder: Path) -> str:
    """How ``--resume-from`` names a checkpoint folder: ``<tag>/step_N``."""
    return f"{folder.parent.name}/{folder.name}"


def checkpoint_error(folder: Path, problem: Problem) -> CheckpointError:
    """The error for an unusable checkpoint: the file, why, and what the user can do about it."""
    path = folder / problem.file
    if problem.legacy:
        return CheckpointError(
            f"checkpoint {folder} {problem.why}",
            hint=f"convert the run folder once with `reprlab convert-checkpoint {run_dir_of(folder)}` "
            "(reads the old files with torch's restricted loader, runs no code), then resume",
        )
    prev = previous_intact(folder)
    if prev is not None:
        hint = (f"resume from the previous intact checkpoint with `--resume --resume-from {resume_name(prev)}` "
                "(the steps after it run again), or start over with --overwrite")  # fmt: skip
    else:
        hint = "there is no earlier intact checkpoint of this stage; start over with --overwrite"
    return CheckpointError(f"checkpoint file {path} {problem.why}", hint=hint)


# ---------------------------------------------------------------------------------------------- loading
def _read_state(folder: Path, stem: str) -> Any:
    tensors = _read_tensors(folder / f"{stem}.safetensors")
    path = folder / f"{stem}.json"
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise _unloadable(folder, path.name, f"cannot be read ({err})") from None
    try:
        return statefile.decode(statefile.loads(text, path.name), tensors)
    except statefile.StateFormatError as err:
        raise _unloadable(folder, path.name, f"is not a reprlab state file ({err})") from None


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise _unloadable(path.parent, path.name, "is missing")
    try:
        return load_file(str(path))
    except Exception as err:  # safetensors raises its own error types on malformed files
        raise _unloadable(path.parent, path.name, f"is not a valid safetensors file ({err})") from None


class _Unloadable(Exception):
    """A part failed to parse or fit; becomes a :class:`CheckpointError` at the top (one hint, no recursion)."""

    def __init__(self, problem: Problem):
        super().__init__(f"{problem.file} {problem.why}")
        self.problem = problem


def _unloadable(folder: Path, name: str, why: str) -> _Unloadable:
    return _Unloadable(Problem(name, why))


def _check_module(folder: Path, name: str, module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    want = module.state_dict()
    missing, unexpected = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    if missing or unexpected:
        raise _unloadable(folder, f"{name}.safetensors",
                          f"does not fit module {name!r} (missing {missing[:3]}, unexpected {unexpected[:3]})")  # fmt: skip
    for key, value in state.items():
        if value.shape != want[key].shape:
            raise _unloadable(folder, f"{name}.safetensors",
                              f"holds {key} of shape {tuple(value.shape)}, the module has "
                              f"{tuple(want[key].shape)}")  # fmt: skip


def _check_optimizer(folder: Path, name: str, opt: torch.optim.Optimizer, state: Any) -> None:
    bad = f"optim_{name}.json"
    if not isinstance(state, dict) or not isinstance(state.get("param_groups"), list):
        raise _unloadable(folder, bad, "is not an optimizer state")
    if not isinstance(state.get("state"), dict):
        raise _unloadable(folder, bad, "is not an optimizer state")
    groups = state["param_groups"]
    if len(groups) != len(opt.param_groups) or any(
        not isinstance(g, dict) or len(g.get("params", ())) != len(own["params"])
        for g, own in zip(groups, opt.param_groups)
    ):
        raise _unloadable(folder, bad, f"does not fit optimizer {name!r} (other parameter groups)")
    ids = {i for g in groups for i in g["params"]}
    if not set(state["state"]) <= ids:
        raise _unloadable(folder, bad, f"holds state for parameters optimizer {name!r} does not have")


def load_checkpoint_dir(
    folder: Path,
    modules: dict[str, torch.nn.Module],
    optimizers: dict[str, torch.optim.Optimizer] | None = None,
    restore_rng: bool = True,
) -> tuple[int, dict[str, Any]]:
    """Restore modules, optimizers and RNG from a checkpoint folder; returns ``(step, extra)``.

    Every part is verified and parsed before any is applied, so on an error nothing has changed.

    Raises:
        CheckpointError: a file is missing, damaged, does not match ``meta.json``, does not fit the
            module or optimizer, or the checkpoint is in the old pickle format.
    """
    folder = Path(folder)
    problem = check_checkpoint(folder)
    if problem is not None:
        raise checkpoint_error(folder, problem)
    meta = read_json(folder / "meta.json")
    try:
        states = {name: _read_tensors(folder / f"{name}.safetensors") for name in modules}
        for name, module in modules.items():
            _check_module(folder, name, module, states[name])
        opt_states = {name: _read_state(folder, f"optim_{name}") for name in optimizers or {}}
        for name, opt in (optimizers or {}).items():
            _check_optimizer(folder, name, opt, opt_states[name])
        rng = None
        if restore_rng:
            rng = _read_state(folder, "rng")
            try:
                _check_rng_state(rng)
            except ValueError as err:
                raise _unloadable(folder, "rng.json", str(err)) from None
    except _Unloadable as err:
        raise checkpoint_error(folder, err.problem) from None
    # everything is verified: apply (these calls now only copy)
    for name, module in modules.items():
        module.load_state_dict(states[name])
    for name, opt in (optimizers or {}).items():
        opt.load_state_dict(opt_states[name])
    if rng is not None:
        set_rng_state(rng)
    return int(meta["step"]), meta.get("extra", {})


def read_state(folder: Path, stem: str) -> Any:
    """The state tree of ``<stem>.safetensors`` + ``<stem>.json`` (an optimizer's, ``rng``), not applied."""
    try:
        return _read_state(Path(folder), stem)
    except _Unloadable as err:
        raise checkpoint_error(Path(folder), err.problem) from None
