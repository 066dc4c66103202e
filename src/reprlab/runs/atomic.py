"""Atomic file writes: write a temporary sibling, fsync, then ``os.replace`` so readers never see half a file.

A write that fails (a full disk, a read-only folder) raises :class:`reprlab.errors.WriteError` naming the
file, and leaves the previous version of the file in place. Each step goes through
:func:`reprlab.runs.faults.file_op`, where tests inject kills and errors.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from reprlab.errors import WriteError
from reprlab.jsonfile import dumps_json as _strict_dumps
from reprlab.runs.faults import file_op


def _current_umask() -> int:
    mask = os.umask(0o022)  # there is no read-only call: set, read, restore
    os.umask(mask)
    return mask


def file_mode() -> int:
    """Mode a plain ``open()`` would give a new file: ``mkstemp`` makes 0600 whatever the user's umask."""
    return 0o666 & ~_current_umask()


def dir_mode() -> int:
    return 0o777 & ~_current_umask()


TMP_SUFFIX = ".tmp"  # temporary siblings are ``.<name>.<random>.tmp``; a resume removes leftovers


def remove_temporaries(folder: Path | str, recursive: bool = True) -> None:
    """Delete the temporary siblings killed writers left in ``folder`` (call only under its writer lock)."""
    folder = Path(folder)
    for tmp in folder.rglob(f".*{TMP_SUFFIX}") if recursive else folder.glob(f".*{TMP_SUFFIX}"):
        if tmp.is_file():
            tmp.unlink(missing_ok=True)


def write_error(err: OSError, path: Path | str, what: str = "") -> WriteError:
    """The user-facing form of an ``OSError`` met while writing ``path`` (full disk, read-only, permission)."""
    if isinstance(err, WriteError):
        return err
    reason = err.strerror or str(err)
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        hint = "the disk is full: free some space, then continue the run with --resume"
    elif err.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        hint = "the folder is read-only or not writable by you: make it writable (or choose another --out)"
    else:
        hint = "check the file system, then continue the run with --resume"
    where = f" {what}" if what else ""
    return WriteError(f"cannot write{where} {path}: {reason}", hint=hint)


def fsync_dir(path: Path | str) -> None:
    """Make a rename or a new entry in ``path`` durable (a no-op where the file system cannot)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _write_temporary(path: Path, data: bytes) -> str:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TMP_SUFFIX)
    try:
        os.fchmod(fd, file_mode())
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return tmp


def atomic_write_bytes(path: Path | str, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a reader sees the old file or the new one, never a part.

    Raises:
        WriteError: the file cannot be written (the old version, if any, is untouched).
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = file_op("write", path, lambda: _write_temporary(path, data))
        try:
            file_op("replace", path, lambda: os.replace(tmp, path))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        file_op("syncdir", path, lambda: fsync_dir(path.parent))
    except OSError as err:
        raise write_error(err, path) from err


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
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None


def temp_sibling_dir(out: Path | str) -> Path:
    """A temporary sibling folder of ``out`` to fill, then :func:`publish_dir` onto ``out`` (exports: a
    finished folder or none)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".tmp_{out.name}_"))
    os.chmod(tmp, dir_mode())  # mkdtemp makes it private; the user's umask decides, as for run folders
    return tmp


def publish_dir(tmp: Path | str, out: Path | str, replace: bool = True) -> Path:
    """Rename the filled ``tmp`` onto ``out``, files with the user's umask. ``replace``: an older ``out`` (the
    run's own folder, written again on resume) is replaced; without it (a user's export folder) only an empty
    ``out`` is, and one that filled up meanwhile is refused, never deleted.

    Raises:
        RunFolderError: ``replace`` is off and ``out`` is a file or a folder that is not empty.
    """
    import shutil

    from reprlab.errors import RunFolderError

    tmp, out = Path(tmp), Path(out)
    for f in tmp.iterdir():
        if f.is_file():
            os.chmod(f, file_mode())
    if out.exists() and not replace:
        if not out.is_dir() or any(out.iterdir()):
            raise RunFolderError(f"{out} exists and is not empty (it was empty or absent when the export began)",
                                 "give a new folder; nothing of its contents was changed")  # fmt: skip
        out.rmdir()
    elif out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out
