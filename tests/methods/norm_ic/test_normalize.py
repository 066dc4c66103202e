"""Centring and Zipfian whitening: the invariants of Yokoi et al. and the leverage artefact."""

import pytest
import torch

from reprlab.methods.norm_ic.normalize import fit_normalizer

TOL = dict(atol=1e-8, rtol=1e-8)  # float64 throughout


def _data(n=400, d=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (
        torch.randn(n, d, generator=g, dtype=torch.float64)
        @ torch.randn(d, d, generator=g, dtype=torch.float64)
        + 3
    )
    p = torch.rand(n, generator=g, dtype=torch.float64) ** 4 + 1e-4  # skewed, Zipf-like weights
    return w, p / p.sum()


def test_zipf_whitening_invariants():
    w, p = _data()
    norm = fit_normalizer("whiten_zipf", w, p)
    wt = norm(w)
    torch.testing.assert_close(p @ wt, torch.zeros(6, dtype=torch.float64), **TOL)  # Σ p w̃ = 0
    torch.testing.assert_close(
        wt.T @ (p[:, None] * wt), torch.eye(6, dtype=torch.float64), **TOL
    )  # Σ p w̃w̃ᵀ = I
    assert float(p @ (wt * wt).sum(1)) == pytest.approx(norm.rank)  # Σ p ‖w̃‖² = rank
    assert norm.rank == 6


def test_uniform_centring_and_whitening():
    w, _ = _data()
    c = fit_normalizer("center_uniform", w)(w)
    torch.testing.assert_close(c.mean(0), torch.zeros(6, dtype=torch.float64), **TOL)
    wt = fit_normalizer("whiten_uniform", w)(w)
    torch.testing.assert_close(wt.T @ wt / len(w), torch.eye(6, dtype=torch.float64), **TOL)


def test_in_sample_whitening_norm_is_leverage_over_probability():
    # the artefact this module avoids: fitted on the evaluated words, ‖w̃_i‖² = h_i / p_i exactly
    w, p = _data(n=8, d=6)
    with pytest.warns(UserWarning, match="whitening 6-d vectors with only 8 fit rows"):  # 8 rows on purpose
        wt = fit_normalizer("whiten_zipf", w, p)(w)
    mu = p @ w
    a = p.sqrt()[:, None] * (w - mu)
    h = torch.diagonal(a @ torch.linalg.pinv(a))  # leverages of the weighted design
    torch.testing.assert_close((wt * wt).sum(1), h / p, atol=1e-6, rtol=1e-6)  # pinv of an 8x6 design


def test_rank_deficient_fit_stays_finite_and_warns_on_small_fit():
    w = torch.randn(10, 3, dtype=torch.float64) @ torch.randn(3, 8, dtype=torch.float64)  # rank 3 in 8-d
    with pytest.warns(UserWarning, match="only 10 fit rows"):
        norm = fit_normalizer("whiten_uniform", w)
    assert norm.rank == 3
    assert torch.isfinite(norm(w)).all()


def test_unknown_kind_and_missing_p():
    w, _ = _data()
    with pytest.raises(ValueError, match="unknown normalisation"):
        fit_normalizer("pca", w)
    with pytest.raises(ValueError, match="needs probabilities"):
        fit_normalizer("center_zipf", w)
