"""Render sections to a self-contained HTML page (figures embedded) and to Markdown (figures as PNG files)."""

from __future__ import annotations

import base64
import html
import io
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from reprlab.report.section import Section
from reprlab.runs.atomic import atomic_write_bytes, atomic_write_text

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;max-width:1100px;margin:2em auto;
padding:0 1em;color:#1d1d1f;line-height:1.45}
h1{border-bottom:2px solid #ddd;padding-bottom:.2em} h2{margin-top:1.6em;border-bottom:1px solid #eee}
table{border-collapse:collapse;margin:.8em 0;font-size:.9em} th,td{border:1px solid #ccc;padding:.25em .6em;
text-align:right} th{background:#f3f3f3} td:first-child,th:first-child{text-align:left}
img{max-width:100%;border:1px solid #eee;margin:.5em 0} pre{background:#f7f7f7;padding:.8em;overflow:auto;
font-size:.85em} .note{color:#555}
"""


def fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != value:
            return "nan"
        if value == 0 or 1e-3 <= abs(value) < 1e5:
            return f"{value:.4g}"
        return f"{value:.3e}"
    return "" if value is None else str(value)


def _columns(rows: Sequence[dict[str, Any]]) -> list[str]:
    cols: list[str] = []
    for row in rows:
        cols.extend(k for k in row if k not in cols)
    return cols


def table_markdown(rows: Sequence[dict[str, Any]]) -> str:
    if not rows:
        return "_(empty)_\n"
    cols = _columns(rows)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def table_html(rows: Sequence[dict[str, Any]]) -> str:
    if not rows:
        return "<p><em>(empty)</em></p>"
    cols = _columns(rows)
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(fmt(r.get(c)))}</td>" for c in cols) + "</tr>" for r in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _figure_png(fig: Any) -> bytes:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _text_html(text: str) -> str:
    # fenced blocks (configs, commands) become <pre>; the rest is paragraphs with **bold** and `code`
    parts = re.split(r"```[a-z]*\n?(.*?)```", text, flags=re.S)
    if len(parts) > 1:
        return "".join(
            f"<pre>{html.escape(p)}</pre>" if i % 2 else _text_html(p.strip())
            for i, p in enumerate(parts)
            if p.strip()
        )
    escaped = html.escape(text)
    escaped = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", escaped)
    escaped = re.sub(r"`(.+?)`", r"<code>\1</code>", escaped)
    return "".join(f"<p>{p.replace(chr(10), '<br>')}</p>" for p in escaped.split("\n\n") if p.strip())


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60] or "figure"


def render(sections: Sequence[Section], title: str, out_dir: Path, stem: str = "report") -> tuple[Path, Path]:
    """Write ``<stem>.html`` and ``<stem>.md`` (figures under ``figures/``) into ``out_dir``."""
    out_dir = Path(out_dir)
    fig_dir = out_dir / "figures"
    md = [f"# {title}\n"]
    body = [f"<h1>{html.escape(title)}</h1>"]
    used: set[str] = set()

    def emit(sec: Section, depth_offset: int = 0) -> None:
        level = min(6, sec.level + depth_offset)
        md.append(f"\n{'#' * level} {sec.title}\n")
        body.append(f"<h{level}>{html.escape(sec.title)}</h{level}>")
        if sec.text:
            md.append(sec.text.strip() + "\n")
            body.append(_text_html(sec.text))
        if sec.table is not None:
            md.append("\n" + table_markdown(sec.table))
            body.append(table_html(sec.table))
        if sec.figure is not None:
            png = _figure_png(sec.figure)
            name = _slug(sec.title)
            while name in used:
                name += "-x"
            used.add(name)
            atomic_write_bytes(fig_dir / f"{name}.png", png)
            md.append(f"\n![{sec.title}](figures/{name}.png)\n")
            b64 = base64.b64encode(png).decode()
            body.append(f'<img alt="{html.escape(sec.title)}" src="data:image/png;base64,{b64}">')
        for child in sec.children:
            emit(child, depth_offset + 1)

    for sec in sections:
        emit(sec)
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{_CSS}</style></head><body>{''.join(body)}</body></html>")  # fmt: skip
    html_path, md_path = out_dir / f"{stem}.html", out_dir / f"{stem}.md"
    atomic_write_text(html_path, page)
    atomic_write_text(md_path, "\n".join(md))
    return html_path, md_path
