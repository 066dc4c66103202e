"""Constant-entropy-rate (CER) length experiment and the CLS/EOS fixed point [protocol ours, brief §4].

Under CER a text's IC, Σ −ln p(wᵢ | w<ᵢ), grows about linearly in its length n. For each document we embed
prefixes of n = n₁ < … < N words and ask whether ‖v_n‖² does the same:

* monotonicity: Spearman ρ(n, ‖v_n‖²);
* linearity: R² and slope of the OLS fit ‖v_n‖² = a + b·n, and R² against the cumulative IC of the prefix;
* curvature: the quadratic term relative to the total change, c₂·(N − n₁)² / |‖v_N‖² − ‖v_{n₁}‖²| of the
  fit c₀ + c₁n + c₂n² (0 linear, ≈ 1 for n², > 0 convex, < 0 concave; a curve falling to a fixed point is
  convex), and the ratio of the first-half slope to the second-half slope (> 1 the change slows down);
* fixed point: cos(v_n, v_N) over the second half, and the relative growth of ‖v‖² over the second half.

Texts: i.i.d. draws from the wordfreq unigram distribution (IC exactly additive), and natural text (the
packaged Lee news documents), both lower-cased and restricted to words every source knows [ours].
"""

from __future__ import annotations

import numpy as np

from reprlab.methods.norm_ic.stats import linear_fit, pearson, spearman


def prefix_grid(n_words: int, n_points: int) -> np.ndarray:
    """Distinct prefix lengths 1 … ``n_words`` spaced evenly, at most ``n_points`` of them."""
    if n_words < 2:
        raise ValueError(f"length experiment needs documents of at least 2 words, got {n_words}")
    return np.unique(np.round(np.linspace(1, n_words, n_points)).astype(int))


def synthetic_docs(words: list[str], p: np.ndarray, n_docs: int, n_words: int, seed: int = 0) -> list[list[str]]:
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


def curve_stats(lengths: np.ndarray, sq: np.ndarray, cum_ic: np.ndarray, vectors: np.ndarray) -> dict[str, float]:
    """Statistics of one prefix curve.

    Args:
        lengths: ``(g,)`` prefix lengths in words.
        sq: ``(g,)`` ‖v_n‖².
        cum_ic: ``(g,)`` cumulative IC of each prefix.
        vectors: ``(g, d_model)`` prefix vectors (for the direction's convergence).
    """
    n = lengths.astype(float)
    _, slope, r2_len = linear_fit(n, sq)
    _, _, r2_ic = linear_fit(cum_ic, sq)
    c2, c1, _ = np.polyfit(n, sq, 2)
    half = len(n) // 2
    s1 = np.polyfit(n[: half + 1], sq[: half + 1], 1)[0]
    s2 = np.polyfit(n[half:], sq[half:], 1)[0]
    unit = vectors / np.linalg.norm(vectors, axis=-1, keepdims=True).clip(1e-30)
    cos_final = unit @ unit[-1]
    return {
        "monotone_spearman": spearman(n, sq),
        "pearson_len": pearson(n, sq),
        "r2_len": r2_len,
        "slope_len": slope,
        "r2_ic": r2_ic,
        "curvature": float(c2 * (n[-1] - n[0]) ** 2 / abs(sq[-1] - sq[0])) if sq[-1] != sq[0] else float("nan"),
        "half_slope_ratio": float(s1 / s2) if s2 != 0 else float("nan"),
        "cos_to_final_2nd_half": float(cos_final[half:-1].mean()) if len(n) > 2 else float("nan"),
        "norm_growth_2nd_half": float((sq[-1] - sq[half]) / abs(sq[-1])) if sq[-1] != 0 else float("nan"),
    }


def aggregate(stats: list[dict[str, float]]) -> dict[str, float]:
    """Mean (and ``_sd``) of each statistic over documents."""
    keys = stats[0].keys()
    out = {}
    for k in keys:
        v = np.array([s[k] for s in stats], float)
        out[k] = float(np.nanmean(v))
        out[k + "_sd"] = float(np.nanstd(v))
    return out
