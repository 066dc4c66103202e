"""Rich progress bars that stay silent in quiet mode (CI) and on non-interactive logs."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")
log = logging.getLogger("reprlab.progress")


def quiet_default() -> bool:
    return os.environ.get("REPRLAB_QUIET", "0") not in ("", "0", "false")


def progress(
    iterable: Iterable[T], total: int | None = None, desc: str = "", disable: bool | None = None
) -> Iterator[T]:
    """Yield from ``iterable`` with a rich progress bar unless disabled (``REPRLAB_QUIET=1``).

    The bar is transient; when the loop ends (or stops early) one INFO line says how far it got and how
    long it took, so ``run.log`` and a quiet console keep a record of every loop.
    """
    if disable is None:
        disable = quiet_default()
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    t0, done = time.perf_counter(), 0
    try:
        if disable:
            for item in iterable:
                yield item
                done += 1
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TimeRemainingColumn())  # fmt: skip
        with Progress(*columns, transient=True) as bar:
            task = bar.add_task(desc or "working", total=total)
            for item in iterable:
                yield item
                done += 1
                bar.advance(task)
    finally:
        of = f" of {total}" if total is not None else ""
        log.info("%s: %d%s done in %.1f s", desc or "loop", done, of, time.perf_counter() - t0)
