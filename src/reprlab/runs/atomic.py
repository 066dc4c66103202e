"""Atomic file writes: write a temporary sibling, fsync, then ``os.replace`` so readers never see half a file."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from reprlab.jsonfile import dumps_json as _strict_dumps


def _current_umask() -> int:
    mask = os.umask(0o022)  # there is no read-only call: set, read, restore
    os.umask(mask)
    return mask


def file_mode() -> int:
    """Mode a plain ``open()`` would give a new file: ``mkstemp`` makes 0600 whatever the user's umask."""
    return 0o666 & ~_current_umask()


def dir_mode() -> int:
    return 0o777 & ~_current_umask()


def atomic_write_bytes(path: Path | str, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, file_mode())
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path | str, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def dumps_json(obj: Any, indent: int | None = 2) -> str:
    # standard JSON: NaN/Infinity become null, numpy/torch values plain (reprlab.jsonfile)
    return _strict_dumps(obj, indent)


def atomic_write_json(path: Path | str, obj: Any) -> None:
    atomic_write_text(path, dumps_json(obj) + "\n")


def read_json(path: Path | str) -> Any:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err
