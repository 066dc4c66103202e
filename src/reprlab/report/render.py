"""Render sections to one self-contained HTML page and to Markdown (figures under ``figures/``).

The page is built for reading: a table of contents in a side column, each section a ``<details>`` block a
reader can fold, text rendered from Markdown by markdown-it-py, wide tables and code scrolling inside their
own box (the page itself never scrolls sideways), prose left-aligned and numbers right-aligned, figures as
SVG. The Markdown twin holds the same text and tables, with the figures as files.
"""

from __future__ import annotations

import base64
import html
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from reprlab.report.figures import render_figure
from reprlab.report.section import Section
from reprlab.runs.atomic import atomic_write_bytes, atomic_write_text

_CSS = """
:root{--fg:#1d1d1f;--muted:#5b5b60;--line:#d9d9de;--bg2:#f5f5f7;--ok:#1a7f37;--bad:#b42318;--na:#6e6e73}
*{box-sizing:border-box}
body{font-family:system-ui,-apple-system,"Segoe UI",Helvetica,Arial,sans-serif;color:var(--fg);margin:0;
line-height:1.5;text-align:left}
.layout{display:grid;grid-template-columns:minmax(0,17rem) minmax(0,1fr);gap:2rem;max-width:90rem;
margin:0 auto;padding:1.5rem}
nav#toc{position:sticky;top:1rem;align-self:start;max-height:calc(100vh - 2rem);overflow:auto;font-size:.9rem;
border-right:1px solid var(--line);padding-right:1rem}
nav#toc ol{list-style:none;margin:0;padding-left:.9rem} nav#toc>ol{padding-left:0}
nav#toc li{margin:.2rem 0} nav#toc a{color:var(--fg);text-decoration:none} nav#toc a:hover{text-decoration:underline}
.toc-title{font-weight:600;margin:0 0 .4rem}
main{min-width:0}
h1{font-size:1.7rem;margin:0 0 1rem;border-bottom:2px solid var(--line);padding-bottom:.3rem}
section{margin:0 0 1rem} section section{margin-left:0}
details>summary{cursor:pointer;list-style-position:outside}
summary h2,summary h3,summary h4,summary h5,summary h6{display:inline;margin:0}
h2{font-size:1.35rem} h3{font-size:1.12rem} h4,h5,h6{font-size:1rem}
details>summary{padding:.35rem 0;border-bottom:1px solid var(--line)}
.body{padding:.4rem 0 .2rem 1.1rem}
p,li{max-width:60rem}
.scroll{overflow-x:auto;max-width:100%;margin:.6rem 0}
.scroll.tall{max-height:34rem;overflow-y:auto}
table{border-collapse:collapse;font-size:.88rem}
th,td{border:1px solid var(--line);padding:.25rem .55rem;text-align:left;vertical-align:top}
th{background:var(--bg2);position:sticky;top:0}
td.num,th.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
td.lines{white-space:pre-wrap;font-size:.84rem;min-width:22rem}
td.prose{min-width:18rem;max-width:34rem}
.caption{font-weight:600;margin:.8rem 0 .2rem}
.verdict{font-weight:600;white-space:nowrap} .holds{color:var(--ok)} .fails{color:var(--bad)} .na{color:var(--na)}
figure{margin:.6rem 0} figure img{max-width:100%;height:auto;border:1px solid var(--line);background:#fff}
pre{background:var(--bg2);padding:.8rem;overflow:auto;font-size:.82rem;max-width:100%}
code{font-size:.9em} .note{color:var(--muted)}
@media (max-width:60rem){.layout{grid-template-columns:minmax(0,1fr)} nav#toc{position:static;max-height:none;
border-right:0;border-bottom:1px solid var(--line);padding-bottom:1rem}}
"""

# A link to a section inside a folded one opens the folds around it (and scrolls there again once open).
_JS = """function reveal(){var id=decodeURIComponent(location.hash.slice(1));var t=id&&document.getElementById(id);
if(!t)return;for(var d=t.parentElement&&t.parentElement.closest('details');d;
d=d.parentElement&&d.parentElement.closest('details')){d.open=true}t.scrollIntoView()}
addEventListener('hashchange',reveal);addEventListener('DOMContentLoaded',function(){if(location.hash)reveal()});"""

VERDICT_CLASS = {"holds": "holds", "does not hold": "fails", "n/a": "na"}
TALL_ROWS = 25  # tables longer than this scroll vertically inside their box too


def plural(n: int, one: str, many: str | None = None) -> str:
    """``"1 seed"``, ``"2 seeds"``: ``n`` and the word that agrees with it (``many`` defaults to ``one + "s"``)."""
    return f"{n} {one if n == 1 else (many or one + 's')}"


def fmt(value: Any) -> str:
    """A table cell as text: 4 significant digits, scientific notation for very small or large numbers."""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return "n/a"
        if value == 0 or 1e-4 <= abs(value) < 1e5:
            return f"{value:.4g}"
        return f"{value:.3e}"
    if isinstance(value, list | tuple):
        return "; ".join(fmt(v) for v in value)
    return "" if value is None else str(value)


def fmt_ci(value: float, lo: float | None, hi: float | None) -> str:
    """``value [lo, hi]`` with one number of decimals for all three: two significant digits of the half-width."""
    if lo is None or hi is None or not all(math.isfinite(v) for v in (value, lo, hi)):
        return fmt(value)
    half = (hi - lo) / 2
    if half <= 0:  # every seed gave the same value
        return f"{fmt(value)} [{fmt(lo)}, {fmt(hi)}]"
    decimals = min(6, max(0, 1 - math.floor(math.log10(half))))
    return f"{value:.{decimals}f} [{lo:.{decimals}f}, {hi:.{decimals}f}]"


def _columns(rows: Sequence[dict[str, Any]]) -> list[str]:
    cols: list[str] = []
    for row in rows:
        cols.extend(k for k in row if k not in cols)
    return cols


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


_NUMBER_TEXT = re.compile(r"^[-−+]?(\d[\d.,]*|\.\d+)(e[-+]?\d+)?( \[[^\]]*\]| \(\d+ seeds?\))?$")


def _numeric(rows: Sequence[dict[str, Any]], col: str) -> bool:
    """A column of numbers (or of formatted "mean [lo, hi]" cells, or "n/a"): right-aligned."""
    vals = [r.get(col) for r in rows if r.get(col) not in (None, "", "–", "n/a")]
    return bool(vals) and all(_is_number(v) or (isinstance(v, str) and _NUMBER_TEXT.match(v)) for v in vals)


def _md_cell(text: str) -> str:
    """A markdown table cell: a pipe or a line break (generated text has both) would end the cell or the row."""
    return re.sub(r"\r\n|\r|\n", "<br>", text).replace("|", "\\|")


def table_markdown(rows: Sequence[dict[str, Any]]) -> str:
    if not rows:
        return "_(empty)_\n"
    cols = _columns(rows)

    def cell(v: Any) -> str:
        return _md_cell(fmt(v) if not isinstance(v, list | tuple) else "<br>".join(map(fmt, v)))

    lines = [
        "| " + " | ".join(map(_md_cell, cols)) + " |",
        "|" + "".join("---:|" if _numeric(rows, c) else "---|" for c in cols),
    ]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _cell_html(value: Any, numeric: bool) -> str:
    if isinstance(value, list | tuple):
        return '<td class="lines">' + "<br>".join(html.escape(fmt(v)) for v in value) + "</td>"
    text = html.escape(fmt(value))
    if isinstance(value, str) and value in VERDICT_CLASS:
        return f'<td><span class="verdict {VERDICT_CLASS[value]}">{text}</span></td>'
    if numeric:
        return f'<td class="num">{text}</td>'
    return f'<td class="prose">{text}</td>' if len(text) > 60 else f"<td>{text}</td>"


def table_html(rows: Sequence[dict[str, Any]]) -> str:
    if not rows:
        return "<p><em>(empty)</em></p>"
    cols = _columns(rows)
    numeric = {c: _numeric(rows, c) for c in cols}
    head = "".join(f"<th{' class=num' if numeric[c] else ''}>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(_cell_html(r.get(c), numeric[c]) for c in cols) + "</tr>" for r in rows)
    tall = " tall" if len(rows) > TALL_ROWS else ""
    return (
        f'<div class="scroll{tall}"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'
    )


_MD = None


def markdown_html(text: str) -> str:
    """Markdown to HTML with markdown-it-py (CommonMark + tables; raw HTML in the text is escaped)."""
    global _MD
    if _MD is None:
        from markdown_it import MarkdownIt

        _MD = MarkdownIt("commonmark", {"html": False}).enable("table")
    out = _MD.render(text)
    return out.replace("<table>", '<div class="scroll"><table>').replace("</table>", "</table></div>")


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60] or "section"


class _Page:
    """Accumulates one report: HTML body, Markdown, the table of contents and figure files."""

    def __init__(self, out_dir: Path) -> None:
        self.fig_dir = out_dir / "figures"
        self.body: list[str] = []
        self.md: list[str] = []
        self.toc: list[tuple[int, str, str]] = []
        self.ids: set[str] = set()
        self.figs: set[str] = set()

    def unique(self, base: str, used: set[str]) -> str:
        name, i = base, 2
        while name in used:
            name, i = f"{base}-{i}", i + 1
        used.add(name)
        return name

    def emit(self, sec: Section, depth: int) -> None:
        level = min(6, sec.level + depth)
        anchor = self.unique(sec.anchor or slug(sec.title), self.ids)
        self.toc.append((level, anchor, sec.title))
        title = html.escape(sec.title)
        opened = "" if sec.collapsed else " open"
        self.body.append(f'<section id="{anchor}" class="lvl{level}"><details{opened}>'
                         f"<summary><h{level}>{title}</h{level}></summary><div class=\"body\">")  # fmt: skip
        self.md.append(f"\n{'#' * level} {sec.title}\n")
        if sec.text:
            self.md.append(sec.text.strip() + "\n")
            self.body.append(markdown_html(sec.text))
        tables = ([("", sec.table)] if sec.table is not None else []) + list(sec.tables)
        for caption, rows in tables:
            if caption:
                self.md.append(f"\n**{caption}**\n")
                self.body.append(f'<p class="caption">{html.escape(caption)}</p>')
            self.md.append("\n" + table_markdown(rows))
            self.body.append(table_html(rows))
        if sec.figure is not None:
            suffix, data = render_figure(sec.figure)
            name = self.unique(slug(sec.title), self.figs)
            atomic_write_bytes(self.fig_dir / f"{name}.{suffix}", data)
            self.md.append(f"\n![{sec.title}](figures/{name}.{suffix})\n")
            mime = "image/svg+xml" if suffix == "svg" else "image/png"
            b64 = base64.b64encode(data).decode()
            self.body.append(f'<figure><img alt="{title}" src="data:{mime};base64,{b64}"></figure>')
        for child in sec.children:
            self.emit(child, depth + 1)
        self.body.append("</div></details></section>")

    def toc_html(self) -> str:
        """Nested ordered lists of links, one level per heading level."""
        if not self.toc:
            return ""

        def items(start: int, level: int) -> tuple[str, int]:
            out, i = [], start
            while i < len(self.toc) and self.toc[i][0] >= level:
                _, anchor, title = self.toc[i]
                sub, i = (
                    ("", i + 1)
                    if i + 1 >= len(self.toc) or self.toc[i + 1][0] <= level
                    else items(i + 1, self.toc[i + 1][0])
                )
                out.append(f'<li><a href="#{anchor}">{html.escape(title)}</a>{sub}</li>')
            return "<ol>" + "".join(out) + "</ol>", i

        top = min(level for level, _, _ in self.toc)
        lists, i = [], 0
        while i < len(self.toc):
            block, i = items(i, top)
            lists.append(block)
        return (
            '<nav id="toc" aria-label="Contents"><p class="toc-title">Contents</p>'
            + "".join(lists)
            + "</nav>"
        )

    def toc_markdown(self) -> str:
        """The contents as a nested list linking GitHub-style heading anchors (the HTML ids differ)."""
        top = min((level for level, _, _ in self.toc), default=2)
        seen: dict[str, int] = {}
        lines = []
        for level, _, title in self.toc:
            base = "".join(c for c in title.lower() if c.isalnum() or c in " -_").replace(" ", "-")
            n = seen.get(base, 0)
            seen[base] = n + 1
            lines.append(f"{'  ' * (level - top)}- [{title}](#{base}{f'-{n}' if n else ''})")
        return "\n".join(lines)


def render(sections: Sequence[Section], title: str, out_dir: Path, stem: str = "report") -> tuple[Path, Path]:
    """Write ``<stem>.html`` and ``<stem>.md`` (figures under ``figures/``) into ``out_dir``."""
    out_dir = Path(out_dir)
    page = _Page(out_dir)
    for sec in sections:
        page.emit(sec, 0)
    doc = (f"<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">"
           f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
           f"<title>{html.escape(title)}</title><style>{_CSS}</style><script>{_JS}</script></head>"
           "<body><div class=\"layout\">"
           f"{page.toc_html()}<main><h1 id=\"top\">{html.escape(title)}</h1>{''.join(page.body)}</main>"
           "</div></body></html>")  # fmt: skip
    md = f"# {title}\n\n**Contents**\n\n{page.toc_markdown()}\n" + "\n".join(page.md)
    html_path, md_path = out_dir / f"{stem}.html", out_dir / f"{stem}.md"
    atomic_write_text(html_path, doc)
    atomic_write_text(md_path, md)
    return html_path, md_path
