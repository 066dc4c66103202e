"""Constant-entropy-rate (CER) length experiment and the CLS/EOS fixed point [protocol ours].

Under CER a text's IC, Σ −ln p(wᵢ | w<ᵢ), grows about linearly in its length n. For each document we embed
prefixes of n = n₁ < … < N words and ask whether ‖v_n‖² does the same:

* monotonicity: Spearman ρ(n, ‖v_n‖²);
* linearity: R² and slope of the OLS fit ‖v_n‖² = a + b·n, and R² against the cumulative IC of the prefix;
* curvature: the quadratic term relative to the total change, c₂·(N − n₁)² / |‖v_N‖² − ‖v_{n₁}‖²| of the
  fit c₀ + c₁n + c₂n² (0 linear, ≈ 1 for n², > 0 convex, < 0 concave; a curve falling to a fixed point is
  convex), and the ratio of the first-half slope to the second-half slope (> 1 the change slows down);
* fixed point: cos(v_n, v_N) over the second half, and the relative growth of ‖v‖² over the second half.

Texts: i.i.d. draws from the wordfreq unigram distribution (IC exactly additive), and natural text (by
default the packaged Wikipedia slice, 106 articles; the Lee news documents as an option), both lower-cased and
restricted to words every source knows [ours]. Every statistic is averaged over documents with a percentile
bootstrap CI over documents [ours].
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from reprlab.methods.norm_ic.compose import compose_all
from reprlab.methods.norm_ic.normalize import single_thread
from reprlab.methods.norm_ic.sources import static_texts
from reprlab.methods.norm_ic.static import StaticEmbeddings
from reprlab.methods.norm_ic.stats import linear_fit, pearson, snap_constant, spearman


def prefix_grid(n_words: int, n_points: int) -> np.ndarray:
    """Distinct prefix lengths 1 … ``n_words`` spaced evenly, at most ``n_points`` of them."""
    if n_words < 2:
        raise ValueError(f"length experiment needs documents of at least 2 words, got {n_words}")
    return np.unique(np.round(np.linspace(1, n_words, n_points)).astype(int))


def synthetic_docs(
    words: list[str], p: np.ndarray, n_docs: int, n_words: int, seed: int = 0
) -> list[list[str]]:
    """``n_docs`` i.i.d. unigram samples of ``n_words`` words, p renormalised over ``words``."""
    rng = np.random.default_rng(seed)
    idx = rng.choice(len(words), size=(n_docs, n_words), p=p / p.sum())
    return [[words[i] for i in row] for row in idx]


def natural_docs(docs: list[list[str]], keep, n_docs: int, n_words: int) -> list[list[str]]:
    """The first ``n_docs`` documents with at least ``n_words`` kept words, cut to ``n_words``.

    Raises:
        ValueError: too few documents are long enough.
    """
    out = []
    for d in docs:
        kept = [w for w in d if keep(w)]
        if len(kept) >= n_words:
            out.append(kept[:n_words])
        if len(out) == n_docs:
            return out
    raise ValueError(f"only {len(out)} documents have {n_words} known words; lower length.n_words")


def curve_stats(
    lengths: np.ndarray, sq: np.ndarray, cum_ic: np.ndarray, vectors: np.ndarray
) -> dict[str, float]:
    """Statistics of one prefix curve.

    Args:
        lengths: ``(g,)`` prefix lengths in words.
        sq: ``(g,)`` ‖v_n‖².
        cum_ic: ``(g,)`` cumulative IC of each prefix.
        vectors: ``(g, d_model)`` prefix vectors (for the direction's convergence).
    """
    n = lengths.astype(float)
    sq = snap_constant(sq)
    _, slope, r2_len = linear_fit(n, sq)
    _, _, r2_ic = linear_fit(cum_ic, sq)
    c2, c1, _ = np.polyfit(n, sq, 2)
    half = len(n) // 2
    s1 = np.polyfit(n[: half + 1], sq[: half + 1], 1)[0]
    s2 = np.polyfit(n[half:], sq[half:], 1)[0]
    if np.ptp(sq) == 0:  # a constant norm has no shape; fitted slopes of it are rounding noise
        c2 = s1 = s2 = 0.0
    unit = vectors / np.linalg.norm(vectors, axis=-1, keepdims=True).clip(1e-30)
    cos_final = unit @ unit[-1]
    return {
        "monotone_spearman": spearman(n, sq),
        "pearson_len": pearson(n, sq),
        "r2_len": r2_len,
        "slope_len": slope,
        "r2_ic": r2_ic,
        "curvature": float(c2 * (n[-1] - n[0]) ** 2 / abs(sq[-1] - sq[0]))
        if sq[-1] != sq[0]
        else float("nan"),
        "half_slope_ratio": float(s1 / s2) if s2 != 0 else float("nan"),
        "cos_to_final_2nd_half": float(cos_final[half:-1].mean()) if len(n) > 2 else float("nan"),
        "norm_growth_2nd_half": float((sq[-1] - sq[half]) / abs(sq[-1])) if sq[-1] != 0 else float("nan"),
    }


def aggregate(
    stats: list[dict[str, float]], n_boot: int = 1000, ci: float = 0.95, seed: int = 0
) -> dict[str, float]:
    """Mean over documents of each statistic, with ``_sd`` and a percentile-bootstrap CI ``_lo``/``_hi``.

    The bootstrap resamples *documents* with replacement (``n_boot`` times) and takes the NaN-aware mean of
    each resample, so the interval says how far the mean could move with other documents of the same kind.
    With fewer than 2 documents, or ``n_boot = 0``, the bounds are NaN.
    """
    keys = stats[0].keys()
    n = len(stats)
    rng = np.random.default_rng(seed + 41)
    idx = rng.integers(0, n, size=(n_boot, n)) if n_boot > 0 and n > 1 else None
    q = (1 - ci) / 2
    out = {}
    for k in keys:
        v = np.array([s[k] for s in stats], float)
        with warnings.catch_warnings():  # all-NaN columns (e.g. undefined curvature) give NaN, not noise
            warnings.simplefilter("ignore", RuntimeWarning)
            out[k] = float(np.nanmean(v))
            out[k + "_sd"] = float(np.nanstd(v))
            if idx is None:
                out[k + "_lo"] = out[k + "_hi"] = float("nan")
            else:
                lo, hi = np.nanquantile(np.nanmean(v[idx], 1), [q, 1 - q])
                out[k + "_lo"], out[k + "_hi"] = float(lo), float(hi)
    return out


def length_curves(docs: dict[str, list[list[str]]], embed, comps: tuple[str, ...], ic_of: dict[str, float],
                  n_points: int, n_boot: int = 1000, ci: float = 0.95, seed: int = 0) -> dict:  # fmt: skip
    """CER statistics per text kind × composition.

    Args:
        docs: ``{"synthetic": [...], "natural": [...]}`` tokenised documents of equal length N.
        embed: ``(doc, grid) -> (dict comp -> (g, d_model) tensor, lm_cum_ic (g,) or None)``.
        comps: compositions to evaluate; ic_of: unigram IC per word; n_points: prefix lengths per document.
        n_boot, ci, seed: percentile bootstrap over documents for every statistic's mean (``_lo``/``_hi``).
    """
    out: dict = {}
    for kind, ds in docs.items():
        per_comp: dict[str, list] = {}
        curves: dict[str, list] = {}
        for doc in ds:
            grid = prefix_grid(len(doc), n_points)
            vecs, lm_cum = embed(doc, grid)
            vecs = {c: v.double().numpy() for c, v in vecs.items()}
            cum_ic = np.cumsum([ic_of[w] for w in doc])[grid - 1]
            for c, v in vecs.items():
                if c not in comps:
                    continue
                sq = (v * v).sum(-1)
                st = curve_stats(grid, sq, cum_ic, v)
                if lm_cum is not None:
                    st["r2_lm_ic"] = float(np.corrcoef(lm_cum, sq)[0, 1] ** 2)
                per_comp.setdefault(c, []).append(st)
                curves.setdefault(c, []).append((sq / sq[-1]).tolist() if sq[-1] != 0 else sq.tolist())
        out[kind] = {c: {**aggregate(s, n_boot, ci, seed), "curve": np.mean(curves[c], 0).tolist(),
                         "grid": grid.tolist(), "n_docs": len(s)} for c, s in per_comp.items()}  # fmt: skip
    return out


def static_embedder(table: StaticEmbeddings, ctx, comps: tuple[str, ...], p_of: dict[str, float]):
    """``embed(doc, grid)`` for :func:`length_curves` over a static table: prefixes are word-item masks."""
    comps_t = tuple(c for c in comps if c != "pooled")

    def embed(doc, grid):
        items = static_texts(table, [doc], p_of)
        x = items.x.expand(len(grid), -1, -1)
        mask = torch.arange(len(doc))[None] < torch.as_tensor(grid)[:, None]
        with single_thread():
            return compose_all(comps_t, x, mask, ctx, p=items.p.expand(len(grid), -1)), None

    return embed
