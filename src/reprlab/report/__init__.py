"""Reports built only from saved run files."""

from reprlab.report.render import render, table_markdown
from reprlab.report.section import Section

__all__ = ["Section", "render", "table_markdown"]
