"""What a folder passed as ``--out`` holds, and replacing a run's results without ever losing or mixing them.

``--overwrite`` moves the old run folder aside (a hidden sibling, same file system, so it is a rename) and
starts the new run in a fresh folder. Only when the new run finishes is the old one deleted; if it fails, the
new folder is removed and the old one renamed back. At no point do files of two runs sit side by side.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from enum import Enum
from pathlib import Path

from reprlab.errors import RunFolderError
from reprlab.runs.lock import LOCK_NAME, RunLock

log = logging.getLogger(__name__)

RECIPE_HEADER = "# recipe:"
ASIDE_TAG = ".replaced-"


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
        raise RunFolderError(
            f"{run_dir} already holds {what}",
            hint="pass --resume to continue it, --overwrite to replace it, or choose another --out",
        )
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


class Replacement:
    """The old results of an ``--overwrite``, kept aside until the new run has finished."""

    def __init__(self, run_dir: Path, aside: Path):
        self.run_dir = run_dir
        self.aside = aside

    @classmethod
    def move_aside(cls, run_dir: Path) -> Replacement:
        """Rename ``run_dir`` to a hidden sibling; fails if another process is writing it."""
        with RunLock.acquire(run_dir):  # nobody may be writing the run we are about to replace
            pass
        aside = run_dir.parent / f".{run_dir.name}{ASIDE_TAG}{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        os.replace(run_dir, aside)
        log.info("--overwrite: old results of %s kept in %s until the new run finishes", run_dir, aside)
        return cls(run_dir, aside)

    def commit(self) -> None:
        """The new run finished: the old results go."""
        shutil.rmtree(self.aside, ignore_errors=True)

    def rollback(self) -> None:
        """The new run failed: remove its folder and put the old results back."""
        if self.run_dir.exists():
            shutil.rmtree(self.run_dir, ignore_errors=True)
        os.replace(self.aside, self.run_dir)
        log.warning("--overwrite: the new run did not finish; the old results are back in %s", self.run_dir)


def leftovers_of_overwrite(run_dir: Path) -> list[Path]:
    """Old results set aside by an ``--overwrite`` whose process was killed before it could clean up."""
    return sorted(run_dir.parent.glob(f".{run_dir.name}{ASIDE_TAG}*"))
