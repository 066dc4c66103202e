"""Fault injection for the run-folder writers: a kill, a full disk or a read-only folder at the Nth file operation.

Every writer that makes a run folder durable (atomic files, checkpoints, metrics, the ``--overwrite`` swap)
performs its file operations through :func:`file_op`, which names each one with a label
``<group>:<verb>:<file name>``, e.g. ``checkpoint:write:model.safetensors`` or ``file:replace:summary.json``.
The group is ``file`` unless a caller set another with :func:`group` (``checkpoint``, ``report``,
``aggregate``). Tests set ``REPRLAB_FAULT`` to make the Nth operation whose label matches a glob fail::

    REPRLAB_FAULT=kill:checkpoint:*:5        # SIGKILL this process right after the 5th checkpoint operation
    REPRLAB_FAULT=enospc:file:*:summary.json:2   # the 2nd operation on summary.json fails with ENOSPC
    REPRLAB_FAULT=erofs:*:1                  # the first operation of any kind fails with EROFS
    REPRLAB_FAULT=pause:overwrite:swap:*:1   # wait at the overwrite swap until the gate file is removed

The spec is ``<action>:<label glob>:<n>`` (the glob may itself contain colons); several specs are
separated by commas. The k-th pause (k = 1, 2, ...) touches ``$REPRLAB_FAULT_GATE.<k>.reached`` and waits
until ``$REPRLAB_FAULT_GATE.<k>`` no longer exists (at most 120 s), so a test can act while a writer stands
at a chosen point. ``REPRLAB_FAULT_LOG=<file>`` appends every label
to a file, so a test can learn the operations of an uninterrupted run and then fail each one in turn.
Nothing here runs unless one of those variables is set.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import fnmatch
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

FAULT_ENV = "REPRLAB_FAULT"
LOG_ENV = "REPRLAB_FAULT_LOG"
GATE_ENV = "REPRLAB_FAULT_GATE"
ACTIONS = ("kill", "enospc", "erofs", "pause")

_group: contextvars.ContextVar[str] = contextvars.ContextVar("reprlab_fault_group", default="file")
_counts: dict[str, int] = {}  # matches seen so far, per spec string (a changed spec starts again at 0)
_pauses: list[int] = [0]


@contextlib.contextmanager
def group(name: str) -> Iterator[None]:
    """Label the file operations inside the block ``<name>:...`` instead of ``file:...``."""
    token = _group.set(name)
    try:
        yield
    finally:
        _group.reset(token)


def label(verb: str, target: Path | str) -> str:
    return f"{_group.get()}:{verb}:{Path(target).name}"


def _parse(spec: str) -> tuple[str, str, int]:
    action, _, rest = spec.partition(":")
    pattern, _, n = rest.rpartition(":")
    if action not in ACTIONS or not pattern or not n.isdigit() or int(n) < 1:
        raise ValueError(
            f"{FAULT_ENV}={spec!r}: expected <action>:<label glob>:<n>, action one of {', '.join(ACTIONS)}"
        )
    return action, pattern, int(n)


def _hit(lab: str) -> str | None:
    """The action to take at this operation, if a fault spec selects it."""
    log = os.environ.get(LOG_ENV)
    if log:
        with open(log, "a", encoding="utf-8") as fh:
            fh.write(lab + "\n")
    hit = None
    for spec in filter(None, os.environ.get(FAULT_ENV, "").split(",")):
        action, pattern, n = _parse(spec)
        if fnmatch.fnmatchcase(lab, pattern):
            _counts[spec] = _counts.get(spec, 0) + 1
            if _counts[spec] == n:
                hit = hit or action
    return hit


def _pause() -> None:
    gate = os.environ.get(GATE_ENV)
    if not gate:
        raise ValueError(f"{FAULT_ENV}=pause:... needs {GATE_ENV}=<file> (removed by the test to go on)")
    _pauses[0] += 1
    gate = f"{gate}.{_pauses[0]}"
    Path(gate + ".reached").touch()
    deadline = time.monotonic() + 120
    while Path(gate).exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def file_op(verb: str, target: Path | str, fn: Callable[[], T]) -> T:
    """Run one file operation ``fn``; under ``REPRLAB_FAULT`` it may fail, pause or be the process's last."""
    if not os.environ.get(FAULT_ENV) and not os.environ.get(LOG_ENV):
        return fn()
    lab = label(verb, target)
    action = _hit(lab)
    if action == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC) + " [injected]", str(target))
    if action == "erofs":
        raise OSError(errno.EROFS, os.strerror(errno.EROFS) + " [injected]", str(target))
    if action == "pause":
        _pause()
    result = fn()
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    return result


def point(verb: str, target: Path | str) -> None:
    """A place where nothing is written but a test may want to pause or stop (e.g. before a rename)."""
    file_op(verb, target, lambda: None)


def reset() -> None:
    """Forget the operations counted so far (tests that set the same spec twice in one process)."""
    _counts.clear()
    _pauses[0] = 0
