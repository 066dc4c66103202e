"""A report section: title, text, an optional table (list of row dicts) and an optional matplotlib figure."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Section:
    """One block of a report. Recipes build these only from files saved in the run folder.

    Args:
        title: heading.
        text: Markdown-ish paragraph (plain text; ``**bold**`` and line breaks are kept).
        table: rows as dicts with the same keys; floats are formatted to 4 significant digits.
        figure: a matplotlib figure; it is embedded as PNG in HTML and saved under ``figures/``.
        level: heading level (2 for a recipe's sections, 1 for a recipe in the combined demo report).
    """

    title: str
    text: str = ""
    table: list[dict[str, Any]] | None = None
    figure: Any = None
    level: int = 2
    children: list[Section] = field(default_factory=list)
