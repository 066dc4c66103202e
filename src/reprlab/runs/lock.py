"""A run folder's writer lock: one process writes a run folder at a time.

The lock is an ``flock`` on ``<run_dir>/.reprlab.lock``, held for the life of the writing process. The file
also records who holds it (pid, host, start time, command) so a second writer can be told whom it collides
with. Because the kernel releases an ``flock`` when its process dies, a lock file left behind by a killed
run is recognised as stale (its record is there but nobody holds the lock) and taken over with a warning;
no pid guessing is needed. ``flock`` is advisory and local: on network file systems that do not support it
two machines are not kept apart.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from reprlab.errors import RunLockedError

LOCK_NAME = ".reprlab.lock"
log = logging.getLogger(__name__)
# Locks this process holds, by real path, with a count: the lock keeps other *processes* out; code in one
# process that opens the same run twice (a resume test, a sweep that reopens a seed) shares it.
_HELD: dict[str, list] = {}


class RunLock:
    """Exclusive writer lock on a run folder; use :meth:`acquire`, release with :meth:`release`."""

    def __init__(self, path: Path, fh: Any, stale: dict[str, Any] | None, key: str = ""):
        self.path = path
        self._fh = fh
        self._key = key
        self.stale = stale  # the record of a dead holder that was taken over, if any

    @classmethod
    def acquire(cls, run_dir: Path | str) -> RunLock:
        """Take the lock or raise :class:`RunLockedError` naming the live holder's pid and start time."""
        path = Path(run_dir) / LOCK_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        key = os.path.realpath(path)
        held = _HELD.get(key)
        if held is not None and held[2] == os.getpid() and not held[0].closed:
            held[1] += 1
            return cls(path, held[0], None, key)
        try:
            fh = open(path, "a+", encoding="utf-8")  # noqa: SIM115 - held open for the life of the lock
        except OSError as err:
            from reprlab.runs.atomic import write_error

            raise write_error(err, path, "the lock file") from err
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_record(fh)
            fh.close()
            who = f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, started {holder.get('started', '?')}"
            raise RunLockedError(
                f"{run_dir} is being written by another reprlab process ({who}): {holder.get('command', '')}",
                hint="wait for it to finish, or stop it, before resuming or overwriting this run",
            ) from None
        stale = _read_record(fh) or None
        if stale:
            log.warning(
                "%s: stale lock of pid %s (started %s) found; that process is gone, taking over",
                run_dir, stale.get("pid"), stale.get("started"),
            )  # fmt: skip
        record = {
            "pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": " ".join(sys.argv),
        }  # fmt: skip
        fh.seek(0)
        fh.truncate()
        fh.write(json.dumps(record) + "\n")
        fh.flush()
        _HELD[key] = [fh, 1, os.getpid()]
        return cls(path, fh, stale, key)

    @staticmethod
    def holder(run_dir: Path | str) -> dict[str, Any] | None:
        """The record of the live process holding ``run_dir``'s lock, or ``None`` (free, stale or absent).

        Probes with a shared lock, so it never blocks a writer for longer than the probe itself.
        """
        path = Path(run_dir) / LOCK_NAME
        held = _HELD.get(os.path.realpath(path))
        if held is not None and held[2] == os.getpid() and not held[0].closed:
            return None  # this process: the lock is shared within it (see _HELD)
        try:
            fh = open(path, encoding="utf-8")  # noqa: SIM115 - closed below
        except OSError:
            return None
        with fh:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return _read_record(fh) or {"pid": "?"}
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
        return None

    def moved(self, run_dir: Path | str) -> None:
        """The locked folder was renamed to ``run_dir`` (the lock, on the open file, went with it)."""
        path = Path(run_dir) / LOCK_NAME
        key = os.path.realpath(path)
        held = _HELD.pop(self._key, None)
        if held is not None:
            _HELD[key] = held
        self.path, self._key = path, key

    def release(self) -> None:
        """Clear the record and drop the lock (a clean exit leaves an empty lock file, not a stale one)."""
        if self._fh is None or self._fh.closed:
            return
        held = _HELD.get(self._key)
        fh, self._fh = self._fh, None
        if held is not None and held[0] is fh:
            held[1] -= 1
            if held[1] > 0:
                return
            del _HELD[self._key]
        self._fh = fh
        try:
            self._fh.seek(0)
            self._fh.truncate()
            self._fh.flush()
        except OSError:  # the folder was moved or removed under us: the lock dies with the descriptor anyway
            pass
        fcntl.flock(self._fh.fileno(), fcntl.LOCK_UN)
        self._fh.close()
        self._fh = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_record(fh: Any) -> dict[str, Any]:
    fh.seek(0)
    text = fh.read().strip()
    if not text:
        return {}
    try:
        rec = json.loads(text)
    except json.JSONDecodeError:
        return {"pid": "?", "command": text[:200]}
    return rec if isinstance(rec, dict) else {}
