"""Section timers: wall and CPU seconds per named part of a run, nested, at near-zero cost.

A run opens one :class:`Timings` with :func:`timing`; library code marks its parts with ``with section("gcg"):``
and never needs the timer passed down (a context variable holds the active one; without one ``section`` is a
no-op). Nested sections join their names with ``/`` (``eval/refusal/gcg``), so a table of top-level sections sums
to the run and each level can be read as shares of its parent.

CPU seconds are the process's (``time.process_time``: every thread, user + system). On a machine shared with other
jobs wall time stretches with the load while CPU time barely does, so a profile taken under load is read from the
CPU column.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

_ACTIVE: ContextVar[Timings | None] = ContextVar("reprlab_timings", default=None)


@dataclass
class Timings:
    """Accumulated ``{path: [wall_s, cpu_s, calls]}``, paths in first-seen order."""

    parts: dict[str, list[float]] = field(default_factory=dict)
    _stack: list[str] = field(default_factory=list)

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        path = "/".join([*self._stack, name])
        self._stack.append(name)
        w0, c0 = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self._stack.pop()
            acc = self.parts.setdefault(path, [0.0, 0.0, 0])
            acc[0] += time.perf_counter() - w0
            acc[1] += time.process_time() - c0
            acc[2] += 1

    def rows(self) -> list[dict]:
        """One row per section: ``path``, ``depth``, ``wall_s``, ``cpu_s``, ``calls``, ``cpu_share`` of the whole
        (the sum of the top-level sections)."""
        total = sum(v[1] for k, v in self.parts.items() if "/" not in k) or 1.0
        return [{"path": k, "depth": k.count("/"), "wall_s": round(v[0], 3), "cpu_s": round(v[1], 3),
                 "calls": int(v[2]), "cpu_share": round(v[1] / total, 4)} for k, v in self.parts.items()]  # fmt: skip


@contextmanager
def timing(timings: Timings | None = None) -> Iterator[Timings]:
    """Make ``timings`` (a fresh one by default) the active timer inside the ``with`` block."""
    t = timings if timings is not None else Timings()
    token = _ACTIVE.set(t)
    try:
        yield t
    finally:
        _ACTIVE.reset(token)


@contextmanager
def section(name: str) -> Iterator[None]:
    """Time the block under ``name`` in the active :class:`Timings`; a no-op when none is active."""
    t = _ACTIVE.get()
    if t is None:
        yield
        return
    with t.section(name):
        yield
