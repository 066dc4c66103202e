"""Evaluation and fit vocabularies sampled across wordfreq frequency bands [ours].

The evaluation words and the fit words (for centring/whitening) are disjoint by construction: whitening
fitted on the test words makes ‖w̃‖² ≈ IC + log leverage by algebra, an artefact we must avoid.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

_ALPHA = re.compile(r"[a-z]+")


@dataclass(frozen=True)
class Vocabulary:
    """Disjoint evaluation and fit word lists.

    Attributes:
        eval_words: words whose ‖v‖² is correlated with IC.
        fit_words: words used only to fit normalisers (never evaluated).
        eval_band: frequency band index (0 = most frequent) of each eval word.
        band_edges: Zipf-frequency edges of the bands, high to low.
    """

    eval_words: list[str]
    fit_words: list[str]
    eval_band: list[int]
    band_edges: list[float]


def candidate_words(top_k: int = 30000, skip_top: int = 100, lang: str = "en", min_len: int = 2) -> list[str]:
    """Alphabetic words among wordfreq's ``top_k`` most frequent, skipping the first ``skip_top``."""
    import wordfreq

    words = wordfreq.top_n_list(lang, top_k, wordlist="large")[skip_top:]
    return [w for w in words if _ALPHA.fullmatch(w) and len(w) >= min_len]


def sample_vocabulary(
    n_eval: int,
    n_fit: int,
    top_k: int = 30000,
    skip_top: int = 100,
    n_bands: int = 10,
    seed: int = 0,
    keep: Callable[[str], bool] | None = None,
) -> Vocabulary:
    """Stratified sample: equal-width Zipf bands, the same number of eval words from each band.

    Args:
        n_eval: number of evaluation words (spread evenly over bands; a band with too few words gives all).
        n_fit: number of fit words, drawn uniformly from the remaining candidates.
        top_k: size of the wordfreq list to draw from.
        skip_top: drop the most frequent function words [ours].
        n_bands: number of Zipf bands.
        seed: sampling seed.
        keep: optional filter (e.g. "is in the GloVe vocabulary").

    Raises:
        ValueError: fewer candidates than ``n_eval + n_fit``.
    """
    import wordfreq

    words = candidate_words(top_k, skip_top)
    if keep is not None:
        words = [w for w in words if keep(w)]
    if len(words) < n_eval + n_fit:
        raise ValueError(
            f"only {len(words)} candidate words for n_eval={n_eval} + n_fit={n_fit}; raise top_k"
        )
    zipf = np.array([wordfreq.zipf_frequency(w, "en", wordlist="large") for w in words])
    edges = np.linspace(zipf.max() + 1e-9, zipf.min() - 1e-9, n_bands + 1)
    band = np.clip(np.searchsorted(-edges, -zipf, side="right") - 1, 0, n_bands - 1)
    rng = np.random.default_rng(seed)
    per_band = int(np.ceil(n_eval / n_bands))
    chosen: list[int] = []
    for b in range(n_bands):
        idx = np.flatnonzero(band == b)
        chosen.extend(rng.choice(idx, size=min(per_band, len(idx)), replace=False).tolist())
    if len(chosen) < n_eval:  # sparse top bands: top up from the remaining words
        rest = np.setdiff1d(np.arange(len(words)), chosen)
        chosen.extend(rng.choice(rest, size=n_eval - len(chosen), replace=False).tolist())
    chosen = (
        sorted(rng.choice(chosen, size=n_eval, replace=False).tolist())
        if len(chosen) > n_eval
        else sorted(chosen)
    )
    rest = np.setdiff1d(np.arange(len(words)), chosen)
    fit = sorted(rng.choice(rest, size=n_fit, replace=False).tolist())
    return Vocabulary(
        eval_words=[words[i] for i in chosen],
        fit_words=[words[i] for i in fit],
        eval_band=[int(band[i]) for i in chosen],
        band_edges=edges.tolist(),
    )
