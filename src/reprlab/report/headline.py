"""A method's curated headline table: the few summary keys a reader looks at first, laid out by hand.

A recipe's entry module declares ``HEADLINE``: one :class:`Headline` or a list of them, or a function of the
summary returning them (when the rows depend on the config, e.g. which models ran). The same declaration
gives the run report's table (each value, with its own interval where the summary has ``K_lo``/``K_hi``)
and the sweep report's (the mean with its 95 % interval over seeds, every seed's value in a figure).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from reprlab.jsonfile import NULL_REASON
from reprlab.report.render import fmt, fmt_ci, plural


@dataclass(frozen=True)
class Headline:
    """Rows × columns of summary keys; the key of a cell is ``pattern.format(row=..., col=...)``.

    Args:
        rows: ``(label, key part)`` per row.
        cols: ``(label, key part)`` per column; the default is one column of values.
        pattern: how a row's and a column's key parts make the summary key.
        corner: the header of the label column.
        caption: one line above the table saying what it shows.
        labels: ``{column key part: {value: text}}`` for coded values (e.g. a verdict of +1/0/−1).
    """

    rows: tuple[tuple[str, str], ...]
    cols: tuple[tuple[str, str], ...] = (("value", ""),)
    pattern: str = "{row}"
    corner: str = "metric"
    caption: str = ""
    labels: Mapping[str, Mapping[Any, str]] = field(default_factory=dict)

    def key(self, row: str, col: str) -> str:
        return self.pattern.format(row=row, col=col)

    def keys(self) -> list[str]:
        return [self.key(r, c) for _, r in self.rows for _, c in self.cols]


def headlines_of(module: Any, summary: Mapping[str, Any]) -> list[Headline]:
    """The ``HEADLINE`` declaration of a recipe's entry module, resolved against one summary."""
    spec = getattr(module, "HEADLINE", None)
    if spec is None:
        return []
    if callable(spec) and not isinstance(spec, Headline):
        spec = spec(summary)
    return [spec] if isinstance(spec, Headline) else list(spec)


def _grid(h: Headline, cell: Callable[[str, str], str | None]) -> list[dict[str, Any]]:
    """Rows of a report table; rows and columns with no value at all are left out."""
    cells = {(r, c): cell(h.key(r, c), c) for _, r in h.rows for _, c in h.cols}
    cols = [(lab, c) for lab, c in h.cols if any(cells[(r, c)] is not None for _, r in h.rows)]
    out = []
    for label, r in h.rows:
        if all(cells[(r, c)] is None for _, c in cols):
            continue
        row: dict[str, Any] = {h.corner: label}
        row.update({lab: "–" if cells[(r, c)] is None else cells[(r, c)] for lab, c in cols})
        out.append(row)
    return out


def run_headline(h: Headline, summary: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The table of one run: each value, with ``[lo, hi]`` where the summary holds ``K_lo`` and ``K_hi``."""

    def cell(key: str, col: str) -> str | None:
        if key not in summary:
            return None
        v = summary[key]
        if v is None:
            return "n/a" + (f" ({summary[key + NULL_REASON]})" if key + NULL_REASON in summary else "")
        if col in h.labels and v in h.labels[col]:
            return h.labels[col][v]
        lo, hi = summary.get(f"{key}_lo"), summary.get(f"{key}_hi")
        if isinstance(lo, int | float) and isinstance(hi, int | float):
            return fmt_ci(v, lo, hi)
        return fmt(v)

    return _grid(h, cell)


def coded_counts(labels: Mapping[Any, str], per_seed: Mapping[str, Any]) -> str | None:
    """A coded key over seeds as its labels' counts ("survives (+) on 2, explained by a null on 1 of 3 seeds"),
    the mean of codes such as +1/0/−1 being no verdict; None unless every seed's value is one of ``labels``."""
    vals = [v for v in per_seed.values() if v is not None]
    if not vals or any(v not in labels for v in vals):
        return None
    counts: dict[str, int] = {}
    for v in vals:
        counts[labels[v]] = counts.get(labels[v], 0) + 1
    parts = sorted(counts.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{t} on {n}" for t, n in parts) + f" of {plural(len(vals), 'seed')}"


def coded_keys(heads: Sequence[Headline], keys: Sequence[str]) -> dict[str, Mapping[Any, str]]:
    """``{summary key: labels}`` for the ``keys`` that hold coded values: the headline cells of a labelled
    column, and any other key whose last part names such a column (every ``*.verdict``, shown or not)."""
    cells = {h.key(r, c): h.labels[c] for h in heads for _, r in h.rows for _, c in h.cols if c in h.labels}
    parts = {c: labels for h in heads for c, labels in h.labels.items() if c}
    out = {}
    for key in keys:
        labels = cells.get(key) or parts.get(key.rsplit(".", 1)[-1])
        if labels is not None:
            out[key] = labels
    return out


def sweep_headline(h: Headline, detail: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The table of a sweep: mean [95 % interval] over seeds for every cell (``aggregate.json`` keys); a coded
    column (``labels``) gives each label's count of seeds instead."""

    def cell(key: str, col: str) -> str | None:
        info = detail.get(key)
        if info is None:
            return None
        if col in h.labels and (text := coded_counts(h.labels[col], info.get("per_seed", {}))) is not None:
            return text
        if info.get("ci_lo") is None:
            return f"{fmt(info['mean'])} (1 seed)"
        return fmt_ci(info["mean"], info["ci_lo"], info["ci_hi"])

    return _grid(h, cell)


def sweep_figure(heads: Sequence[Headline], detail: Mapping[str, Mapping[str, Any]], max_panels: int = 6):
    """Every seed's value (dots), the mean (bar) and its 95 % interval (whisker) for headline keys.

    A grid headline gets one panel per column (its rows side by side, on one scale); a one-column headline
    gets one panel per row, since its rows are different quantities on different scales.
    """
    from reprlab.report.figures import pyplot

    panels = []
    for h in heads:
        if len(h.cols) > 1:
            for col_label, col in h.cols:
                if col in h.labels:  # a coded column (a verdict) has no mean to draw
                    continue
                entries = [(label, detail[h.key(r, col)]) for label, r in h.rows if h.key(r, col) in detail]
                if entries:
                    panels.append((col_label, entries))
        else:
            col = h.cols[0][1]
            panels += [(label.strip(" …"), [("", detail[h.key(r, col)])]) for label, r in h.rows
                       if h.key(r, col) in detail]  # fmt: skip
    panels = panels[:max_panels]
    if not panels:
        return None
    plt = pyplot()
    widths = [max(1.0, 0.9 * len(e)) + 1.2 for _, e in panels]
    cols = min(len(panels), 3 if max(len(e) for _, e in panels) > 2 else 6)
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(
        rows, cols, figsize=(min(16.0, sum(widths[:cols]) + 0.5), 3.8 * rows), squeeze=False
    )
    for ax, (title, entries) in zip(axes.flat, panels):
        for i, (_, info) in enumerate(entries):
            vals = [v for v in info["per_seed"].values() if isinstance(v, int | float)]
            jitter = [i + 0.08 * (j - (len(vals) - 1) / 2) for j in range(len(vals))]
            lo, hi = info.get("ci_lo"), info.get("ci_hi")
            ax.bar(i, info["mean"], width=0.6, color="C0", alpha=0.3, label="mean" if i == 0 else None)
            if lo is not None:
                ax.errorbar(i, info["mean"], yerr=[[info["mean"] - lo], [hi - info["mean"]]], color="C0", capsize=8,
                            lw=2, label="95% interval" if i == 0 else None)  # fmt: skip
            ax.scatter(jitter, vals, s=26, color="0.25", zorder=3, label="one seed" if i == 0 else None)
        labels = [e[0] for e in entries]
        ax.set_xticks(range(len(entries)), labels, rotation=30 if len(entries) > 4 else 0,
                      ha="right" if len(entries) > 4 else "center")  # fmt: skip
        ax.set_title(title)
        ax.grid(axis="x", visible=False)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, frameon=False, bbox_to_anchor=(0.5, -0.01))
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig
