"""A report section: title, text, an optional table (list of row dicts) and an optional matplotlib figure."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Section:
    """One block of a report. Recipes build these only from files saved in the run folder.

    Args:
        title: heading (also the entry in the table of contents).
        text: Markdown (CommonMark plus tables), rendered by markdown-it-py.
        table: rows as dicts; floats are formatted to 4 significant digits, a list of strings is shown one
            line per item. Wide tables scroll inside their box.
        figure: a matplotlib figure; embedded as SVG (PNG at 2x when the SVG would be heavy) in HTML and
            saved under ``figures/``. Build it with :func:`reprlab.report.figures.pyplot` for readable sizes.
        level: heading level (2 for a recipe's sections, 1 for a recipe in the combined demo report).
        children: sub-sections, one heading level deeper.
        collapsed: start folded (reference material: configs, environment, long tables); the reader opens it.
        tables: further ``(caption, rows)`` tables after ``table``.
    """

    title: str
    text: str = ""
    table: list[dict[str, Any]] | None = None
    figure: Any = None
    level: int = 2
    children: list[Section] = field(default_factory=list)
    collapsed: bool = False
    tables: list[tuple[str, list[dict[str, Any]]]] = field(default_factory=list)
    anchor: str = ""
