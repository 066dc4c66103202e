"""Information content sources: IC(w) = −ln p(w) in nats (``unit="bits"`` divides by ln 2).

Three sources, all returning natural-log IC unless told otherwise:

* ``wordfreq_ic``: unigram p(w) = ``wordfreq.word_frequency(w, lang)`` [ours: our default source].
  wordfreq's "large" English list is quantised to 0.01 Zipf, so ties are common (Spearman uses average ranks).
* ``counts_ic``: p(w) = (c(w) + k) / (N + k·|V|) over a user's corpus, add-k smoothed [ours].
* ``lm_surprisal``: the language model's own token probabilities. IC of a word is the sum of its subword
  surprisals −ln p(t_i | context, t_<i) after a fixed context [ours: the context is one special token so the
  word is not at position 0, where decoder states are attention sinks]. Computed in ``extract`` from the same
  forward pass that yields the hidden states.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np

LN2 = math.log(2.0)


def to_unit(ic_nats: np.ndarray, unit: str) -> np.ndarray:
    """Convert IC from nats to ``unit`` ("nats" or "bits")."""
    if unit == "nats":
        return ic_nats
    if unit == "bits":
        return ic_nats / LN2
    raise ValueError(f"unit must be 'nats' or 'bits', got {unit!r}")


def wordfreq_probability(words: Sequence[str], lang: str = "en", wordlist: str = "large") -> np.ndarray:
    """Unigram probabilities from wordfreq, shape ``(n,)``.

    Raises:
        ValueError: a word has frequency 0 (wordfreq does not know it), naming the first few such words.
    """
    import wordfreq

    if not words:
        raise ValueError("wordfreq_probability: empty word list")
    p = np.array([wordfreq.word_frequency(w, lang, wordlist=wordlist) for w in words], dtype=np.float64)
    zero = [w for w, pi in zip(words, p) if pi <= 0]
    if zero:
        raise ValueError(
            f"wordfreq has no frequency for {len(zero)} words, e.g. {zero[:5]}; filter them first"
        )
    return p


def wordfreq_ic(
    words: Sequence[str], lang: str = "en", unit: str = "nats", wordlist: str = "large"
) -> np.ndarray:
    """IC(w) = −ln p_wordfreq(w), shape ``(n,)``; equals (9 − zipf)·ln 10 in nats."""
    return to_unit(-np.log(wordfreq_probability(words, lang, wordlist)), unit)


def corpus_counts(sentences: Iterable[Sequence[str]]) -> Counter:
    """Token counts over an iterable of tokenised sentences."""
    counts: Counter = Counter()
    for sent in sentences:
        counts.update(sent)
    if not counts:
        raise ValueError("corpus_counts: the corpus has no tokens")
    return counts


def counts_ic(
    words: Sequence[str], counts: Counter, smoothing: float = 1.0, unit: str = "nats"
) -> np.ndarray:
    """IC from corpus counts with add-k smoothing, shape ``(n,)``.

    Args:
        words: the words to score.
        counts: token counts of the corpus (``corpus_counts``).
        smoothing: k in (c + k)/(N + k|V|); k > 0 keeps unseen words finite [ours].
        unit: "nats" or "bits".
    """
    if smoothing < 0:
        raise ValueError(f"smoothing must be >= 0, got {smoothing}")
    total = sum(counts.values())
    denom = total + smoothing * (len(counts) + 1)  # +1: one shared slot for unseen words
    c = np.array([counts.get(w, 0) for w in words], dtype=np.float64) + smoothing
    if np.any(c <= 0):
        bad = [w for w, ci in zip(words, c) if ci <= 0][:5]
        raise ValueError(f"words unseen in the corpus with smoothing=0: {bad}")
    return to_unit(-np.log(c / denom), unit)


def unigram_prefix_ic(ic_words: np.ndarray) -> np.ndarray:
    """Cumulative unigram IC of prefixes: ``out[n-1] = Σ_{i<n} IC(w_i)``, shape ``(N,)`` (CER reference)."""
    return np.cumsum(ic_words)
