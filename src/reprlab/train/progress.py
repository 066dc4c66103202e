"""Rich progress bars that stay silent in quiet mode (CI) and on non-interactive logs."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def quiet_default() -> bool:
    return os.environ.get("REPRLAB_QUIET", "0") not in ("", "0", "false")


def progress(
    iterable: Iterable[T], total: int | None = None, desc: str = "", disable: bool | None = None
) -> Iterator[T]:
    """Yield from ``iterable`` with a rich progress bar unless disabled (``REPRLAB_QUIET=1``)."""
    if disable is None:
        disable = quiet_default()
    if disable:
        yield from iterable
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TimeRemainingColumn())  # fmt: skip
    with Progress(*columns, transient=True) as bar:
        task = bar.add_task(desc or "working", total=total)
        for item in iterable:
            yield item
            bar.advance(task)
