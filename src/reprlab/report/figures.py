"""Figures for reports: one readable style, SVG output (PNG at 2x as fallback), and a curve smoother.

Reports are read on screens at about 1,000 px of content width: titles at 13 pt, axis labels at 12 pt, ticks
and legends at 10 pt keep text legible when a figure is scaled to that width. Draw with :func:`pyplot`
(the Agg backend with this style applied) rather than importing pyplot directly.

Fits drawn over data must match the data's shape: :func:`lowess` is a local linear smoother that follows a
saturating or bending cloud, where a straight least-squares line would not; say in the caption which
smoother a figure shows.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

STYLE = {
    "font.size": 11,
    "axes.titlesize": 13,
    "axes.labelsize": 12,
    "xtick.labelsize": 10,
    "ytick.labelsize": 10,
    "legend.fontsize": 10,
    "figure.titlesize": 14,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "svg.fonttype": "path",  # text as outlines: the figure looks the same without our fonts installed
    "svg.hashsalt": "reprlab",  # stable element ids, so the same figure gives the same file
    "figure.max_open_warning": 0,  # a report builds all its sections' figures before rendering them
}
MAX_SVG_BYTES = 1_500_000  # above this (dense scatters) the PNG at 2x is lighter for the browser
PNG_DPI = 200  # 2x the 100-dpi layout size


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend with the report style applied."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update(STYLE)
    return plt


def render_figure(fig: Any) -> tuple[str, bytes]:
    """``(suffix, bytes)`` of ``fig`` as SVG, or as PNG at 2x when the SVG would exceed ``MAX_SVG_BYTES``;
    closes the figure."""
    import matplotlib.pyplot as plt

    try:
        buf = io.BytesIO()
        with plt.rc_context({k: v for k, v in STYLE.items() if k.startswith("svg.")}):
            fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
        if buf.tell() <= MAX_SVG_BYTES:
            return "svg", buf.getvalue()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=PNG_DPI, bbox_inches="tight")
        return "png", buf.getvalue()
    finally:
        plt.close(fig)


def lowess(
    x: np.ndarray, y: np.ndarray, frac: float = 0.3, points: int = 60
) -> tuple[np.ndarray, np.ndarray]:
    """Locally weighted linear regression (LOWESS, Cleveland 1979) without robustness iterations.

    At each of ``points`` grid positions across the range of ``x``, a straight line is fitted by weighted
    least squares to the ``frac`` share of points nearest in ``x``, with tricube weights; the curve is those
    fits' values at the grid positions.

    Args:
        x: ``(n,)`` positions.
        y: ``(n,)`` values.
        frac: share of the points in each local fit (wider is smoother).
        points: number of grid positions of the returned curve.

    Returns:
        ``(grid, curve)``, both ``(points,)``; empty when fewer than 3 finite points.
    """
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    ok = np.isfinite(x) & np.isfinite(y)
    x, y = x[ok], y[ok]
    if len(x) < 3:
        return np.array([]), np.array([])
    k = max(3, int(np.ceil(frac * len(x))))
    grid = np.linspace(x.min(), x.max(), points)
    curve = np.empty(points)
    for i, x0 in enumerate(grid):
        d = np.abs(x - x0)
        idx = np.argpartition(d, k - 1)[:k]
        h = d[idx].max() or 1.0
        w = (1 - (d[idx] / h) ** 3) ** 3
        xs, ys = x[idx], y[idx]
        sw = w.sum()
        if sw == 0:
            curve[i] = ys.mean()
            continue
        xm, ym = (w * xs).sum() / sw, (w * ys).sum() / sw
        var = (w * (xs - xm) ** 2).sum()
        slope = (w * (xs - xm) * (ys - ym)).sum() / var if var > 0 else 0.0
        curve[i] = ym + slope * (x0 - xm)
    return grid, curve
