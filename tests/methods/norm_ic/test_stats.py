"""Correlation statistics against scipy.stats, plus bootstrap and input checks."""

import numpy as np
import pytest
from scipy import stats as sps

from reprlab.methods.norm_ic.stats import correspondence, linear_fit, pearson, resample_ranks, spearman


def test_pearson_spearman_match_scipy_including_ties():
    rng = np.random.default_rng(0)
    x = np.round(rng.normal(size=300), 1)  # rounding creates many ties, as wordfreq's quantised IC does
    y = x + rng.normal(size=300)
    assert pearson(x, y) == pytest.approx(sps.pearsonr(x, y).statistic, abs=1e-12)
    assert spearman(x, y) == pytest.approx(sps.spearmanr(x, y).statistic, abs=1e-12)


def test_r2_slope_intercept_match_scipy_linregress():
    rng = np.random.default_rng(1)
    x = rng.normal(size=200)
    y = 3.0 - 2.0 * x + rng.normal(size=200)
    a, b, r2 = linear_fit(x, y)
    ref = sps.linregress(x, y)
    assert (a, b, r2) == pytest.approx((ref.intercept, ref.slope, ref.rvalue**2), abs=1e-10)


def test_bootstrap_ci_brackets_estimate_and_shrinks_with_n():
    rng = np.random.default_rng(2)
    widths = []
    for n in (100, 2000):
        x = rng.normal(size=n)
        c = correspondence(x, 0.5 * x + rng.normal(size=n), n_boot=300, seed=0)
        assert c.pearson_lo <= c.pearson <= c.pearson_hi
        assert c.spearman_lo <= c.spearman <= c.spearman_hi
        assert c.r2 == pytest.approx(c.pearson**2)
        widths.append(c.pearson_hi - c.pearson_lo)
    assert widths[1] < widths[0]  # CI width ~ 1/sqrt(n): 20x more data must narrow it


def test_bad_inputs():
    with pytest.raises(ValueError, match="at least 3"):
        correspondence(np.ones(2), np.ones(2))
    with pytest.raises(ValueError, match="non-finite"):
        correspondence(np.array([1.0, 2.0, np.nan]), np.ones(3))
    with pytest.raises(ValueError, match="equal-length"):
        correspondence(np.ones(4), np.ones(5))


def test_resample_ranks_equal_scipy_rankdata():
    rng = np.random.default_rng(3)
    values = np.round(rng.normal(size=50), 1)  # ties inside the data and, by resampling, across copies
    idx = rng.integers(0, 50, size=(7, 50))
    np.testing.assert_array_equal(resample_ranks(values, idx), sps.rankdata(values[idx], axis=1))


def test_snap_constant_only_flattens_rounding_noise():
    """Normalised float32 vectors: ‖v‖² = 1 up to ~1e-7, snapped to one value (correlations NaN, not noise);
    real norms that differ by 1e-3 relative are left alone."""
    import torch

    from reprlab.methods.norm_ic.stats import correspondence, snap_constant

    v = torch.nn.functional.normalize(
        torch.randn(200, 384, generator=torch.Generator().manual_seed(0)), dim=-1
    )
    sq = (v.double() ** 2).sum(-1).numpy()
    assert np.ptp(sq) > 0  # rounding noise is there before the snap
    snapped = snap_constant(sq)
    assert np.ptp(snapped) == 0
    ic = np.arange(200.0)
    assert np.isnan(correspondence(ic, snapped, n_boot=10).spearman)
    real = 1.0 + 1e-3 * np.random.default_rng(0).random(200)
    assert np.array_equal(snap_constant(real), real)


def test_constant_norms_give_no_fit_and_no_correlation_whatever_the_rounding_of_their_mean():
    """A normalised embedding's ‖v‖² is 1 up to rounding; snapped to a constant, its mean may still differ from
    its values in the last bit, which left a positive "total variance" of 1e-32 and an R² (or r) of pure
    rounding noise: R² 0.968 on one layer, −21.7 on another. Every snapped curve must give NaN."""
    from reprlab.methods.norm_ic.stats import linear_fit, pearson, snap_constant

    rng = np.random.default_rng(0)
    x = np.arange(12, dtype=float)
    for _ in range(300):
        y = snap_constant(rng.uniform(0.5, 2.0) * (1 + rng.normal(0, 1e-8, size=12)))
        assert np.ptp(y) == 0
        _, slope, r2 = linear_fit(x, y)
        assert np.isnan(r2) and slope == 0.0
        assert np.isnan(pearson(x, y))
