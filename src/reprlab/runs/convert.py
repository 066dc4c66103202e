"""``reprlab convert-checkpoint RUN``: rewrite old checkpoints (pickled ``optim_*.pt``, ``rng.pt``) as safetensors + JSON.

reprlab no longer reads pickles from a run folder: unpickling a file can run any code its author chose.
Checkpoints written before the safetensors + JSON format are refused on ``--resume`` with a pointer here.
This command, run by the user on purpose, reads each old file with torch's restricted unpickler
(``torch.load(weights_only=True)``, with only numpy's array reconstruction allow-listed, which is what the
old ``rng.pt`` needs), checks the old CRC32 manifest, and writes the new files and a SHA-256 manifest.
A file the restricted unpickler refuses is converted only with ``--trust`` (a full unpickle: for run folders
you made yourself). Each checkpoint folder is rebuilt beside the old one and swapped in, so an interrupted
conversion leaves the old checkpoint or the new one.
"""

from __future__ import annotations

import logging
import os
import shutil
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from reprlab.errors import CheckpointError, RunFolderError
from reprlab.runs.atomic import dumps_json, file_mode, read_json
from reprlab.runs.checkpoint import FORMAT, legacy_files, list_checkpoints, sha256_file, write_state
from reprlab.runs.lock import RunLock

log = logging.getLogger(__name__)


def _numpy_array_globals() -> list[Any]:
    """What an ``np.random.get_state()`` tuple needs beyond torch's default weights-only allow-list."""
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]
    return [_reconstruct, np.ndarray, np.dtype, *(type(np.dtype(t)) for t in ("uint32", "float64", "int64"))]


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def load_legacy_part(path: Path, trust: bool) -> Any:
    """One old pickled part, through the restricted unpickler unless ``trust``.

    Raises:
        CheckpointError: the restricted unpickler refuses the file and ``trust`` is not set.
    """
    try:
        with torch.serialization.safe_globals(_numpy_array_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # UnpicklingError and whatever a malformed file raises
        if not trust:
            raise CheckpointError(
                f"{path} holds more than tensors, numbers and numpy arrays; the restricted loader refused it "
                f"({type(err).__name__}: {str(err).splitlines()[0][:200]})",
                hint="only if you made this run folder yourself (or trust whoever did): "
                "`reprlab convert-checkpoint RUN --trust` unpickles it in full, which can run code",
            ) from None
    log.warning("--trust: unpickling %s in full", path)
    return torch.load(path, map_location="cpu", weights_only=False)


def convert_checkpoint_dir(folder: Path, trust: bool = False) -> bool:
    """Rewrite one old-format checkpoint folder in place (atomically); ``False`` if it was not old-format."""
    pickles = legacy_files(folder)
    meta = read_json(folder / "meta.json")
    if not pickles and meta.get("format") == FORMAT:
        return False
    for name, info in (meta.get("files") or {}).items():  # the old manifest: size and CRC32
        path = folder / name
        if (
            not path.is_file()
            or path.stat().st_size != info.get("size")
            or ("crc32" in info and _crc32(path) != info["crc32"])
        ):
            raise CheckpointError(f"{path} does not match the old manifest in {folder / 'meta.json'}",
                                  hint="this checkpoint is damaged; convert the run's other checkpoints and "
                                  "resume from an earlier one with --resume-from")  # fmt: skip
    new = folder.with_name(f".convert-{folder.name}")
    shutil.rmtree(new, ignore_errors=True)
    new.mkdir()
    try:
        for f in folder.iterdir():
            if f.name.endswith(".safetensors"):
                shutil.copy2(f, new / f.name)
        for name in pickles:
            stem = Path(name).stem
            state = load_legacy_part(folder / name, trust)
            if stem == "rng":
                state = dict(state)
                state["numpy"] = _numpy_state_dict(state["numpy"])
            write_state(new, stem, state)
        for f in new.iterdir():
            os.chmod(f, file_mode())
        files = {f.name: {"size": f.stat().st_size, "sha256": sha256_file(f)} for f in sorted(new.iterdir())}
        record = {**meta, "format": FORMAT, "files": files, "converted_from": sorted(meta.get("files") or {})}
        (new / "meta.json").write_text(dumps_json(record) + "\n", encoding="utf-8")
        os.chmod(new / "meta.json", file_mode())
        old = folder.with_name(f".legacy-{folder.name}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(folder, old)
        os.replace(new, folder)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(new, ignore_errors=True)
    return True


def _numpy_state_dict(state: Any) -> Any:
    """The old ``np.random.get_state()`` tuple as the dict ``get_state(legacy=False)`` gives."""
    if isinstance(state, dict):
        return state
    rs = np.random.RandomState()
    rs.set_state(state)
    return rs.get_state(legacy=False)


def convert_run(run_dir: Path, trust: bool = False) -> list[Path]:
    """Convert every old-format checkpoint of a run folder (or of each run in a sweep folder)."""
    run_dir = Path(run_dir)
    if not (run_dir / "checkpoints").is_dir() and not list(run_dir.glob("seed-*/checkpoints")):
        raise RunFolderError(f"{run_dir} has no checkpoints/ folder (and no seed-*/checkpoints)",
                             hint="pass the run folder given as --out")  # fmt: skip
    done: list[Path] = []
    runs = [run_dir] if (run_dir / "checkpoints").is_dir() else sorted(run_dir.glob("seed-*"))
    for run in runs:
        if not (run / "checkpoints").is_dir():
            continue
        with RunLock.acquire(run):  # nobody may be resuming it meanwhile
            for tag in sorted((run / "checkpoints").iterdir()):
                for ckpt in list_checkpoints(tag) if tag.is_dir() else []:
                    if convert_checkpoint_dir(ckpt, trust=trust):
                        log.info("converted %s", ckpt)
                        done.append(ckpt)
    return done
