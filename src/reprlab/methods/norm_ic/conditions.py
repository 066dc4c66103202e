"""Measurable diagnostics for the paper's sufficient conditions [ours: the paper's conditions are unknown].

Our hypothesis for the two conditions ([ours], to be checked against the paper before citing):

* (C1) ‖v_w‖² is affine in IC(w). Measured by the linear fit's R², the gain of a quadratic fit over it
  (ΔR², lack of linearity), and the Spearman correlation of per-band means (monotone on average).
* (C2) ⟨v_x, v_y⟩ ≈ PMI(x, y), the ICDS reading of the inner product as shared information. Measured by
  correlating inner products with corpus PMI over co-occurring word pairs (window ±w, count ≥ ``min_count``).

Plus the anisotropy ‖E v‖² / E‖v‖² over the fit set, which predicts the mean-pooling fixed point [ours].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from reprlab.methods.norm_ic.stats import linear_fit, pearson, spearman


def c1_linearity(ic: np.ndarray, sq: np.ndarray, band: np.ndarray) -> dict[str, float]:
    """C1 diagnostics for ``sq`` (‖v‖²) against ``ic``, both ``(n,)``; ``band`` ``(n,)`` frequency bands."""
    if np.ptp(sq) == 0:  # constant norms (e.g. an exactly normalised state): linearity is undefined
        return {
            "c1_r2": float("nan"),
            "c1_delta_r2_quadratic": float("nan"),
            "c1_band_spearman": float("nan"),
        }
    _, _, r2 = linear_fit(ic, sq)
    coef = np.polyfit(ic, sq, 2)
    res = sq - np.polyval(coef, ic)
    r2q = 1.0 - float((res**2).sum()) / float(((sq - sq.mean()) ** 2).sum())
    bands = np.unique(band)
    mean_ic = [ic[band == b].mean() for b in bands]
    mean_sq = [sq[band == b].mean() for b in bands]
    rho_band = spearman(np.array(mean_ic), np.array(mean_sq)) if len(bands) > 2 else float("nan")
    return {"c1_r2": r2, "c1_delta_r2_quadratic": r2q - r2, "c1_band_spearman": rho_band}


@dataclass(frozen=True)
class PairPMI:
    """Co-occurring word pairs and their PMI (natural log).

    Attributes:
        left, right: word indices into the vocabulary list, ``(n_pairs,)``.
        pmi: ``(n_pairs,)``.
        counts: ``(n_pairs,)`` co-occurrence counts.
    """

    left: np.ndarray
    right: np.ndarray
    pmi: np.ndarray
    counts: np.ndarray


def cooccurrence_pmi(docs: list[list[str]], vocab: list[str], window: int = 5, min_count: int = 5) -> PairPMI:
    """PMI(x, y) = ln[p(x, y) / (p(x) p(y))] for pairs of ``vocab`` words within ±``window`` tokens.

    p(x, y) is the share of all (token, neighbour) position pairs in the corpus, p(x) the unigram share.
    Pairs are unordered (x < y by vocabulary index), vectorised with numpy per offset.
    """
    index = {w: i for i, w in enumerate(vocab)}
    tokens = np.array([index.get(t, -1) for d in docs for t in d + [None]], dtype=np.int64)  # None: doc break
    breaks = np.array([t is None for d in docs for t in d + [None]])
    n_tok = int((~breaks).sum())
    if n_tok == 0:
        raise ValueError("cooccurrence_pmi: empty corpus")
    unigram = np.bincount(tokens[tokens >= 0], minlength=len(vocab)).astype(np.float64)
    keys, total_pairs = [], 0
    doc_id = np.cumsum(breaks)
    for off in range(1, window + 1):
        a, b = tokens[:-off], tokens[off:]
        # a pair counts only inside one document and never with the break marker itself
        same_doc = (doc_id[:-off] == doc_id[off:]) & ~breaks[:-off] & ~breaks[off:]
        total_pairs += int(same_doc.sum())
        ok = (a >= 0) & (b >= 0) & (a != b) & same_doc
        lo, hi = np.minimum(a[ok], b[ok]), np.maximum(a[ok], b[ok])
        keys.append(lo * len(vocab) + hi)
    uniq, cnt = np.unique(np.concatenate(keys), return_counts=True)
    keep = cnt >= min_count
    uniq, cnt = uniq[keep], cnt[keep].astype(np.float64)
    left, right = uniq // len(vocab), uniq % len(vocab)
    # each unordered pair was counted once per position pair; p(x,y) over position pairs in either order
    p_xy = cnt / total_pairs / 2.0
    p_x, p_y = unigram[left] / n_tok, unigram[right] / n_tok
    return PairPMI(left, right, np.log(p_xy / (p_x * p_y)), cnt)


def c2_inner_product(vectors: np.ndarray, pairs: PairPMI) -> dict[str, float]:
    """C2: correlation of ⟨v_x, v_y⟩ with PMI(x, y); ``vectors`` ``(n_vocab, d_model)`` in vocab order."""
    if len(pairs.pmi) < 3:
        return {"c2_pearson": float("nan"), "c2_spearman": float("nan"), "c2_pairs": len(pairs.pmi)}
    dots = (vectors[pairs.left] * vectors[pairs.right]).sum(-1)
    return {"c2_pearson": pearson(pairs.pmi, dots), "c2_spearman": spearman(pairs.pmi, dots),
            "c2_pairs": len(pairs.pmi)}  # fmt: skip


def anisotropy(vectors: np.ndarray) -> float:
    """‖mean v‖² / mean ‖v‖² of ``(n, d_model)``: 0 isotropic around 0, 1 all vectors equal."""
    return float((vectors.mean(0) ** 2).sum() / (vectors**2).sum(-1).mean())


def context_kl(docs: list[list[str]], words: list[str], window: int = 5) -> tuple[np.ndarray, np.ndarray]:
    """Oyama et al.'s target KL(p(·|w) ‖ p(·)) from ±``window`` co-occurrence counts, natural log.

    Contexts range over every corpus token type; p(·) is the context marginal of the same counts.

    Returns:
        ``(kl, n_w)``, both ``(len(words),)``: the KL (NaN for words absent from the corpus) and each word's
        corpus count, so callers can keep frequent words only (Oyama use n_w > 10³ on 17M tokens).
    """
    from scipy.sparse import coo_matrix

    types: dict[str, int] = {}
    ids_list = [[types.setdefault(t, len(types)) for t in d] for d in docs]
    rows, cols = [], []
    for ids in ids_list:
        a = np.asarray(ids, dtype=np.int64)
        for off in range(1, window + 1):
            if len(a) > off:
                rows += [a[:-off], a[off:]]
                cols += [a[off:], a[:-off]]
    if not rows:
        raise ValueError("context_kl: no co-occurrences in the corpus")
    r, c = np.concatenate(rows), np.concatenate(cols)
    v = len(types)
    counts = coo_matrix((np.ones_like(r, dtype=np.float64), (r, c)), shape=(v, v)).tocsr()
    counts.sum_duplicates()
    row_tot = np.asarray(counts.sum(1)).ravel()
    q = np.asarray(counts.sum(0)).ravel() / counts.sum()
    coo = counts.tocoo()
    p = coo.data / row_tot[coo.row]
    kl_all = np.bincount(coo.row, weights=p * np.log(p / q[coo.col]), minlength=v)
    n_all = np.bincount(np.concatenate([np.asarray(i, dtype=np.int64) for i in ids_list]), minlength=v)
    idx = np.array([types.get(w, -1) for w in words])
    kl = np.where(idx >= 0, kl_all[np.maximum(idx, 0)], np.nan)
    n_w = np.where(idx >= 0, n_all[np.maximum(idx, 0)], 0)
    return kl, n_w
