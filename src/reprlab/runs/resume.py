"""What a run folder must pass before ``--resume`` changes anything in it.

A resume continues from the newest checkpoint of every stage (tag). Each of those is checked against its
``meta.json`` (size and SHA-256 of every file) before ``metrics.jsonl`` is cut back or anything else is
touched. A damaged or unverifiable checkpoint stops the resume with the file's name and the previous intact
checkpoint; the user picks it explicitly with ``--resume-from <tag>/step_N``. A resume never falls back on
its own, and never becomes a fresh start.

``--resume-from`` sets every checkpoint and stage result written after the chosen checkpoint aside (hidden
``.superseded-`` / ``.invalidated-`` names, kept for inspection), so the run continues from exactly there.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from reprlab.errors import CheckpointError, ConfigError
from reprlab.runs.atomic import read_json, remove_temporaries
from reprlab.runs.checkpoint import (
    TMP_PREFIX,
    TRASH_PREFIX,
    check_checkpoint,
    checkpoint_error,
    list_checkpoints,
    resume_name,
    step_of,
)

SUPERSEDED = ".superseded-"
INVALIDATED = ".invalidated-"


def tag_dirs(run_dir: Path) -> list[Path]:
    root = run_dir / "checkpoints"
    return (
        sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
        if root.is_dir()
        else []
    )


def clean_leftovers(run_dir: Path) -> None:
    """Remove what killed writers leave behind: temporary files and half-made or half-pruned checkpoints.

    Only called under the run folder's lock, so no live writer owns them.
    """
    remove_temporaries(run_dir)
    for tag in tag_dirs(run_dir):
        for d in [*tag.glob(f"{TMP_PREFIX}*"), *tag.glob(f"{TRASH_PREFIX}*")]:
            shutil.rmtree(d, ignore_errors=True)


def _time_of(path: Path) -> float:
    """When a checkpoint or stage result was written (its recorded time, else the file's)."""
    meta = path / "meta.json" if path.is_dir() else path
    try:
        t = read_json(meta).get("time")
    except (ValueError, OSError, AttributeError):
        t = None
    return float(t) if isinstance(t, int | float) else meta.stat().st_mtime


def resolve_resume_from(run_dir: Path, spec: str) -> Path:
    """``step_N``, ``N``, ``<tag>/step_N`` or ``<tag>/N`` -> that checkpoint folder of ``run_dir``.

    Raises:
        ConfigError: no such checkpoint, or a bare step that more than one stage has.
    """
    tag, _, step = spec.strip().rpartition("/")
    digits = step.removeprefix("step_")
    if not digits.isdigit():
        raise ConfigError(
            f"--resume-from {spec!r}: expected step_N or <stage>/step_N, e.g. train/step_00000020"
        )
    tags = [d for d in tag_dirs(run_dir) if not tag or d.name == tag]
    found = [c for d in tags for c in list_checkpoints(d) if step_of(c) == int(digits)]
    have = ", ".join(resume_name(c) for d in tag_dirs(run_dir) for c in list_checkpoints(d)) or "none"
    if not found:
        raise ConfigError(f"--resume-from {spec!r}: {run_dir} has no such checkpoint (it has: {have})")
    if len(found) > 1:
        raise ConfigError(f"--resume-from {spec!r} names a step of several stages; add the stage: "
                          + ", ".join(resume_name(c) for c in found))  # fmt: skip
    return found[0]


def _set_aside(path: Path, prefix: str) -> Path:
    dest = path.with_name(f"{prefix}{path.name}")
    n = 1
    while dest.exists():
        n += 1
        dest = path.with_name(f"{prefix}{n}-{path.name}")
    os.replace(path, dest)
    return dest


def rewind_to(run_dir: Path, target: Path, log: logging.Logger) -> None:
    """Set aside every checkpoint and stage result written after ``target`` (checked intact first)."""
    problem = check_checkpoint(target, parse=True)
    if problem is not None:
        raise checkpoint_error(target, problem)
    since = _time_of(target)
    for tag in tag_dirs(run_dir):
        for ckpt in list_checkpoints(tag):
            later = step_of(ckpt) > step_of(target) if tag == target.parent else _time_of(ckpt) > since
            if later:
                moved = _set_aside(ckpt, SUPERSEDED)
                log.warning(
                    "--resume-from %s: checkpoint %s set aside as %s", resume_name(target), ckpt, moved.name
                )
    for stage in sorted((run_dir / "stages").glob("*.json")):
        if _time_of(stage) > since:
            _set_aside(stage, INVALIDATED)
            log.warning("--resume-from %s: stage %s finished after it; it will run again", resume_name(target),
                        stage.stem)  # fmt: skip


def check_resumable(run_dir: Path) -> None:
    """Raise :class:`CheckpointError` unless the newest checkpoint of every stage is intact and parses."""
    for tag in tag_dirs(run_dir):
        ckpts = list_checkpoints(tag)
        if ckpts:
            problem = check_checkpoint(ckpts[-1], parse=True)
            if problem is not None:
                raise checkpoint_error(ckpts[-1], problem)


def prepare_resume(run_dir: Path, resume_from: str | None, log: logging.Logger) -> None:
    """Everything a resume checks and rewinds before it touches ``metrics.jsonl`` (called under the lock)."""
    clean_leftovers(run_dir)
    if resume_from:
        rewind_to(run_dir, resolve_resume_from(run_dir, resume_from), log)
    try:
        check_resumable(run_dir)
    except CheckpointError as err:
        raise CheckpointError(f"--resume: {err}", hint=err.hint) from None


__all__ = ["check_resumable", "clean_leftovers", "prepare_resume", "resolve_resume_from", "rewind_to"]
