"""What a folder passed as ``--out`` holds, and replacing a run's results without ever losing or mixing them.

``--overwrite`` swaps a fresh, locked folder in for the old run folder and keeps the old results aside (a
hidden sibling, same file system). Only when the new run finishes is the old one deleted; if it fails, the
two are swapped back. At no point do files of two runs sit side by side, and the writer's lock is held from
the check to the clean-up: the old folder's lock before and across the swap, the new folder's lock from
before the swap to the end, so a second writer is refused at every moment. The swap is one
``renameat2(RENAME_EXCHANGE)`` where the file system has it (ext4, xfs, btrfs, tmpfs); elsewhere two renames,
with a second writer that slips between them refused because the set-aside folder is still locked.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
import time
from enum import Enum
from pathlib import Path

from reprlab.errors import RunFolderError, RunLockedError
from reprlab.runs import faults
from reprlab.runs.lock import LOCK_NAME, RunLock

log = logging.getLogger(__name__)

RECIPE_HEADER = "# recipe:"
ASIDE_TAG = ".replaced-"
STAGING_TAG = ".replacing-"


class FolderState(Enum):
    MISSING = "missing"
    EMPTY = "empty"
    RUN = "run"  # a reprlab run folder (config.yaml whose first line names the recipe)
    SWEEP = "sweep"  # a seed sweep folder (sweep.json)
    FOREIGN = "foreign"  # anything else: the user's files, never touched


def folder_state(path: Path | str) -> FolderState:
    path = Path(path)
    if not path.exists():
        return FolderState.MISSING
    if not path.is_dir():
        return FolderState.FOREIGN
    if (path / "sweep.json").is_file():
        return FolderState.SWEEP
    cfg = path / "config.yaml"
    if cfg.is_file():
        try:
            with open(cfg, encoding="utf-8", errors="replace") as fh:
                if fh.readline().startswith(RECIPE_HEADER):
                    return FolderState.RUN
        except OSError:
            pass
    if not any(p.name != LOCK_NAME for p in path.iterdir()):
        return FolderState.EMPTY
    return FolderState.FOREIGN


def is_finished(run_dir: Path | str) -> bool:
    """A run folder whose recipe returned: ``summary.json`` is written last, atomically."""
    return folder_state(run_dir) is FolderState.RUN and (Path(run_dir) / "summary.json").is_file()


def check_out_folder(run_dir: Path, resume: bool, overwrite: bool) -> FolderState:
    """Refuse every ``--out``/``--resume``/``--overwrite`` combination that would lose or mix results."""
    if resume and overwrite:
        raise RunFolderError("--resume and --overwrite contradict each other; pass one of them")
    refuse_if_being_written(run_dir)  # first: a live writer's folder may look empty or unfinished
    state = folder_state(run_dir)
    if resume:
        if state is FolderState.MISSING:
            raise RunFolderError(
                f"--resume: {run_dir} does not exist", hint="drop --resume to start a new run"
            )
        if state is not FolderState.RUN:
            raise RunFolderError(
                f"--resume: {run_dir} is not a reprlab run folder (no config.yaml starting with '{RECIPE_HEADER}')",
                hint="point --out at the folder of the run to continue",
            )
    elif state is FolderState.RUN and not overwrite:
        what = "a finished run" if is_finished(run_dir) else "an unfinished run"
        hint = "pass --resume to continue it, --overwrite to replace it, or choose another --out"
        aside = [p for p in leftovers_of_overwrite(run_dir) if ASIDE_TAG in p.name]
        if (
            aside
        ):  # a killed --overwrite leaves the new, unfinished run in place and the old results set aside
            what += f"; the results it replaced are kept in {aside[-1]}"
            hint += (
                f"; to go back to the old results, remove {run_dir.name} and rename {aside[-1].name} to it"
            )
        raise RunFolderError(f"{run_dir} already holds {what}", hint=hint)
    elif state in (FolderState.FOREIGN, FolderState.SWEEP):
        kind = (
            "a seed sweep" if state is FolderState.SWEEP else "a non-empty folder that is not a reprlab run"
        )
        raise RunFolderError(
            f"--out {run_dir} is {kind}; reprlab will not write into it" + (" (not even with --overwrite)"
                                                                            if overwrite else ""),
            hint="choose a new or empty folder for --out",
        )  # fmt: skip
    return state


def _who(holder: dict) -> str:
    return f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, started {holder.get('started', '?')}"


def refuse_if_being_written(run_dir: Path) -> None:
    """Raise :class:`RunLockedError` if a live process writes ``run_dir`` or is replacing it (``--overwrite``)."""
    holder = RunLock.holder(run_dir)
    if holder is not None:
        raise RunLockedError(
            f"{run_dir} is being written by another reprlab process ({_who(holder)}): {holder.get('command', '')}",
            hint="wait for it to finish, or stop it, before writing this run folder",
        )
    refuse_if_being_replaced(run_dir)


def refuse_if_being_replaced(run_dir: Path) -> None:
    """Raise :class:`RunLockedError` if a live ``--overwrite`` holds a set-aside or staging folder of ``run_dir``."""
    for other in _overwrite_folders(run_dir):
        holder = RunLock.holder(other)
        if holder is not None:
            raise RunLockedError(
                f"{run_dir} is being replaced by an --overwrite in progress ({_who(holder)}): "
                f"{holder.get('command', '')}",
                hint="wait for it to finish, or stop it, before writing this run folder",
            )


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); ``False`` where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


class Replacement:
    """The old results of an ``--overwrite``, kept aside (and locked) until the new run has finished."""

    def __init__(self, run_dir: Path, aside: Path, old_lock: RunLock, new_lock: RunLock):
        self.run_dir = run_dir
        self.aside = aside
        self.old_lock = old_lock  # on the old results, wherever they are
        self.new_lock = new_lock  # on the new run folder; the run writes under it

    @classmethod
    def move_aside(cls, run_dir: Path) -> Replacement:
        """Put a fresh, locked folder in ``run_dir``'s place; fails if another process writes either."""
        with faults.group("overwrite"):
            old_lock = RunLock.acquire(run_dir)  # nobody may be writing the run we are about to replace
            stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
            aside = run_dir.parent / f".{run_dir.name}{ASIDE_TAG}{stamp}"
            staging = run_dir.parent / f".{run_dir.name}{STAGING_TAG}{stamp}"
            new_lock = None
            try:
                staging.mkdir()
                new_lock = RunLock.acquire(staging)
                faults.point("swap", run_dir)
                if _exchange(staging, run_dir):
                    os.replace(staging, aside)  # staging now holds the old results
                else:
                    os.replace(run_dir, aside)
                    os.replace(staging, run_dir)
            except BaseException:
                if new_lock is not None:
                    new_lock.release()
                if staging.exists() and not (staging / "config.yaml").exists():
                    shutil.rmtree(staging, ignore_errors=True)
                old_lock.release()
                raise
            old_lock.moved(aside)
            new_lock.moved(run_dir)
            faults.point("swapped", run_dir)
        log.info("--overwrite: old results of %s kept in %s until the new run finishes", run_dir, aside)
        return cls(run_dir, aside, old_lock, new_lock)

    def commit(self) -> None:
        """The new run finished: the old results go, then both locks."""
        with faults.group("overwrite"):
            faults.point("commit", self.run_dir)
            shutil.rmtree(self.aside, ignore_errors=True)
        self.old_lock.release()
        self.new_lock.release()

    def rollback(self) -> None:
        """The new run failed: swap the old results back, remove the new folder, then release both locks."""
        with faults.group("overwrite"):
            faults.point("rollback", self.run_dir)
            if self.run_dir.exists() and _exchange(self.aside, self.run_dir):
                shutil.rmtree(self.aside, ignore_errors=True)
            else:
                shutil.rmtree(self.run_dir, ignore_errors=True)
                os.replace(self.aside, self.run_dir)
        self.old_lock.moved(self.run_dir)
        self.new_lock.release()
        self.old_lock.release()
        log.warning("--overwrite: the new run did not finish; the old results are back in %s", self.run_dir)


def _overwrite_folders(run_dir: Path) -> list[Path]:
    return sorted([*run_dir.parent.glob(f".{run_dir.name}{ASIDE_TAG}*"),
                   *run_dir.parent.glob(f".{run_dir.name}{STAGING_TAG}*")])  # fmt: skip


def leftovers_of_overwrite(run_dir: Path) -> list[Path]:
    """Old results set aside by an ``--overwrite`` whose process was killed before it could clean up.

    An empty staging folder of a killed ``--overwrite`` is removed; folders a live process holds are not
    leftovers (see :func:`refuse_if_being_written`).
    """
    out = []
    for other in _overwrite_folders(run_dir):
        if RunLock.holder(other) is not None:
            continue
        if STAGING_TAG in other.name and not any(p.name != LOCK_NAME for p in other.iterdir()):
            shutil.rmtree(other, ignore_errors=True)
            continue
        out.append(other)
    return out
