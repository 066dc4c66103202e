"""Correspondence statistics between ‖v‖² and IC, with percentile bootstrap confidence intervals.

Pearson r = cov(x, y)/(σ_x σ_y); Spearman ρ = Pearson on average ranks (ties share their mean rank);
R² = 1 − SS_res/SS_tot of the OLS fit y = a + b·x (equal to r² for simple regression).
The bootstrap resamples word indices with replacement ``n_boot`` times, all resamples vectorised [ours].
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass

import numpy as np
from scipy.stats import rankdata


@dataclass(frozen=True)
class Correspondence:
    """Correlation of x (IC) with y (‖v‖²) over ``n`` items, with ``ci``-level bootstrap bounds."""

    n: int
    pearson: float
    pearson_lo: float
    pearson_hi: float
    spearman: float
    spearman_lo: float
    spearman_hi: float
    r2: float
    r2_lo: float
    r2_hi: float
    slope: float
    intercept: float

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def snap_constant(sq: np.ndarray, rel: float = 1e-5) -> np.ndarray:
    """``sq`` made exactly constant when its spread is float32 rounding (relative spread <= ``rel``).

    A normalised embedding (a sentence-transformers pipeline's Normalize module) has ‖v‖² = 1 only up to
    rounding (~1e-7); ranks and fits of that noise would be numbers without meaning, while a constant gives
    NaN correlations and R², which the tables show as undefined [ours].
    """
    sq = np.asarray(sq, np.float64)
    mean = float(np.mean(sq)) if sq.size else 0.0
    if sq.size and np.ptp(sq) <= rel * abs(mean):
        return np.full_like(sq, mean)
    return sq


def _pearson_rows(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Row-wise Pearson of ``(b, n)`` arrays; NaN where a row is constant."""
    xc = x - x.mean(-1, keepdims=True)
    yc = y - y.mean(-1, keepdims=True)
    den = np.sqrt((xc * xc).sum(-1) * (yc * yc).sum(-1))
    # a constant row's mean may differ from its values in the last bit, leaving den tiny but positive
    varies = (np.ptp(x, -1) > 0) & (np.ptp(y, -1) > 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(varies & (den > 0), (xc * yc).sum(-1) / den, np.nan)


def resample_ranks(values: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Average ranks of each bootstrap resample ``values[idx[b]]`` without sorting each one.

    Equal to ``scipy.stats.rankdata(values[idx], axis=1)``: a resample only repeats original values, so the
    rank of a value is (resampled items below its tie group) + (its group's count + 1)/2, from per-group
    counts and a cumulative sum. O(b·(n + groups)) instead of O(b·n log n), the bottleneck otherwise.

    Args:
        values: ``(n,)``.
        idx: ``(b, n_resample)`` integer indices into ``values``.
    """
    uniq, group = np.unique(values, return_inverse=True)
    g = len(uniq)
    b = idx.shape[0]
    gid = group[idx]  # (b, n_resample)
    counts = np.bincount((np.arange(b)[:, None] * g + gid).ravel(), minlength=b * g).reshape(b, g)
    avg = np.cumsum(counts, 1) - (counts - 1) / 2.0
    return np.take_along_axis(avg, gid, 1)


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    return float(_pearson_rows(np.asarray(x, float)[None], np.asarray(y, float)[None])[0])


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    return pearson(rankdata(x), rankdata(y))


def linear_fit(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """OLS ``y = a + b x``; returns ``(a, b, R²)``."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    b, a = np.polyfit(x, y, 1)
    ss_res = float(((y - (a + b * x)) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    if np.ptp(y) == 0:  # a constant (see snap_constant): its mean may differ in the last bit, ss_tot is noise
        return float(a), 0.0, float("nan")
    return float(a), float(b), (1.0 - ss_res / ss_tot) if ss_tot > 0 else float("nan")


def correspondence(ic: np.ndarray, sq_norm: np.ndarray, n_boot: int = 500, ci: float = 0.95,
                   seed: int = 0) -> Correspondence:  # fmt: skip
    """Pearson, Spearman and R² of ``sq_norm`` on ``ic`` (both ``(n,)``) with bootstrap CIs.

    Raises:
        ValueError: shapes differ, fewer than 3 items, or non-finite values (named by count).
    """
    x, y = np.asarray(ic, np.float64), np.asarray(sq_norm, np.float64)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"ic and sq_norm must be equal-length vectors, got {x.shape} and {y.shape}")
    if len(x) < 3:
        raise ValueError(f"need at least 3 words for correlations, got {len(x)}")
    bad = ~(np.isfinite(x) & np.isfinite(y))
    if bad.any():
        raise ValueError(f"{int(bad.sum())} non-finite IC or norm values")
    a, b, r2 = linear_fit(x, y)
    r, rho = pearson(x, y), spearman(x, y)
    lo_q, hi_q = (1 - ci) / 2, 1 - (1 - ci) / 2
    if n_boot > 0:
        rng = np.random.default_rng(seed)
        idx = rng.integers(0, len(x), size=(n_boot, len(x)))
        xb, yb = x[idx], y[idx]
        rb = _pearson_rows(xb, yb)
        rhob = _pearson_rows(resample_ranks(x, idx), resample_ranks(y, idx))
        with warnings.catch_warnings():  # constant norms give all-NaN resamples; NaN bounds say so
            warnings.simplefilter("ignore", RuntimeWarning)
            q = lambda v: np.nanquantile(v, [lo_q, hi_q])  # noqa: E731
            (r_lo, r_hi), (s_lo, s_hi), (r2_lo, r2_hi) = q(rb), q(rhob), q(rb**2)
    else:
        r_lo = r_hi = s_lo = s_hi = r2_lo = r2_hi = float("nan")
    return Correspondence(len(x), r, float(r_lo), float(r_hi), rho, float(s_lo), float(s_hi),
                          r2, float(r2_lo), float(r2_hi), b, a)  # fmt: skip
