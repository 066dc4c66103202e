"""IC sources (known answers) and the disjoint, frequency-stratified vocabulary."""

import math
from collections import Counter

import numpy as np
import pytest
import wordfreq

from reprlab.methods.norm_ic.ic import counts_ic, to_unit, wordfreq_ic
from reprlab.methods.norm_ic.vocab import sample_vocabulary


def test_wordfreq_ic_is_minus_ln_p_and_matches_zipf():
    words = ["the", "research", "zebra"]
    ic = wordfreq_ic(words)
    for w, v in zip(words, ic):
        assert v == pytest.approx(-math.log(wordfreq.word_frequency(w, "en")), rel=1e-12)
        # zipf = log10(p·1e9) is rounded to 0.01 by wordfreq, so IC = (9 − zipf)·ln 10 up to 0.005·ln 10
        assert v == pytest.approx(
            (9 - wordfreq.zipf_frequency(w, "en")) * math.log(10), abs=0.006 * math.log(10)
        )
    np.testing.assert_allclose(wordfreq_ic(words, unit="bits"), ic / math.log(2))


def test_unknown_word_is_a_clear_error():
    with pytest.raises(ValueError, match="no frequency"):
        wordfreq_ic(["qzxqzxqzx"])
    with pytest.raises(ValueError, match="unit"):
        to_unit(np.ones(1), "hartley")


def test_counts_ic_known_answer():
    counts = Counter({"a": 3, "b": 1})
    # add-1 over |V| + 1 = 3 slots: p(a) = 4/7, p(b) = 2/7, p(unseen) = 1/7
    np.testing.assert_allclose(counts_ic(["a", "b", "zzz"], counts), -np.log([4 / 7, 2 / 7, 1 / 7]))


def test_vocabulary_is_disjoint_and_spans_bands():
    voc = sample_vocabulary(200, 300, top_k=5000, n_bands=5, seed=0)
    assert len(voc.eval_words) == 200 and len(voc.fit_words) == 300
    assert not set(voc.eval_words) & set(voc.fit_words)
    assert set(voc.eval_band) == set(range(5))
    assert all(w.isalpha() for w in voc.eval_words)
    with pytest.raises(ValueError, match="candidate words"):
        sample_vocabulary(5000, 5000, top_k=2000)
