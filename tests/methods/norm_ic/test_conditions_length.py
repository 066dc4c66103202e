"""Sufficient-condition diagnostics and CER curve statistics on cases with known answers."""

import math

import numpy as np
import pytest

from reprlab.methods.norm_ic.conditions import anisotropy, c1_linearity, c2_inner_product, cooccurrence_pmi
from reprlab.methods.norm_ic.length import curve_stats, natural_docs, prefix_grid, synthetic_docs


def test_pmi_known_answer():
    docs = [["a", "b", "a", "b"], ["c", "a"]]
    pairs = cooccurrence_pmi(docs, ["a", "b", "c"], window=1, min_count=1)
    got = {
        (int(a), int(b)): (float(c), float(v))
        for a, b, c, v in zip(pairs.left, pairs.right, pairs.counts, pairs.pmi)
    }
    # window 1: position pairs (a,b),(b,a),(a,b) in doc 1 and (c,a) in doc 2 -> 4 position pairs, 6 tokens
    # p(a,b) = 3/4/2 (either order), p(a) = 3/6, p(b) = 2/6 -> PMI = ln(0.375 / (1/6))
    assert got[(0, 1)][0] == 3 and got[(0, 1)][1] == pytest.approx(math.log(0.375 * 6))
    assert got[(0, 2)][1] == pytest.approx(math.log((1 / 8) / (3 / 6 * 1 / 6)))
    assert (1, 2) not in got  # b and c never co-occur; doc boundaries are respected


def test_c2_is_one_when_inner_products_equal_pmi():
    docs = [list("abcabdacbd"), list("dcbadbca")]
    pairs = cooccurrence_pmi(docs, list("abcd"), window=2, min_count=1)
    assert len(pairs.pmi) == 6  # every pair co-occurs, so a Gram matrix can hold all PMIs
    g = np.zeros((4, 4))
    g[pairs.left, pairs.right] = g[pairs.right, pairs.left] = pairs.pmi
    g += 10 * np.eye(4)  # diagonal dominance makes it positive definite, so vectors with this Gram exist
    v = np.linalg.cholesky(g)
    out = c2_inner_product(v, pairs)
    # Pearson only: tied PMIs come back as dots differing at 1e-16, which Spearman's ranks would split
    assert out["c2_pearson"] == pytest.approx(1.0, abs=1e-9) and out["c2_pairs"] == 6


def test_anisotropy_extremes():
    v = np.ones((5, 3))
    assert anisotropy(v) == pytest.approx(1.0)
    assert anisotropy(np.concatenate([v, -v])) == pytest.approx(0.0)


def test_c1_on_exact_affine_relation():
    ic = np.linspace(5, 15, 50)
    out = c1_linearity(ic, 2 * ic + 1, np.repeat(np.arange(5), 10))
    assert out["c1_r2"] == pytest.approx(1.0)
    assert abs(out["c1_delta_r2_quadratic"]) < 1e-10
    assert out["c1_band_spearman"] == pytest.approx(1.0)


def test_curve_stats_linear_and_fixed_point():
    n = prefix_grid(40, 10)
    assert n[0] == 1 and n[-1] == 40
    d = np.ones((len(n), 4))
    lin = curve_stats(n, 3.0 * n, 2.0 * n, d * n[:, None])  # ‖v‖² ∝ n exactly, fixed direction
    assert lin["r2_len"] == pytest.approx(1.0) and lin["r2_ic"] == pytest.approx(1.0)
    assert lin["slope_len"] == pytest.approx(3.0)
    assert abs(lin["curvature"]) < 1e-8 and lin["half_slope_ratio"] == pytest.approx(1.0)
    assert lin["cos_to_final_2nd_half"] == pytest.approx(1.0)
    quad = curve_stats(n, n.astype(float) ** 2, 2.0 * n, d)
    assert quad["half_slope_ratio"] < 1  # convex: the raw-sum regime
    # an exact n² curve is all quadratic: c₂(N − 1)²/(N² − 1) = (N − 1)/(N + 1)
    assert quad["curvature"] == pytest.approx(39 / 41)


def test_docs_sampling():
    docs = synthetic_docs(["a", "b", "c"], np.array([0.5, 0.3, 0.2]), 3, 7, seed=0)
    assert len(docs) == 3 and all(len(d) == 7 for d in docs)
    nat = natural_docs([["x"] * 3, ["a", "zz", "b", "c", "a"]], {"a", "b", "c"}.__contains__, 1, 4)
    assert nat == [["a", "b", "c", "a"]]
    with pytest.raises(ValueError, match="only 0 documents"):
        natural_docs([["a"]], {"a"}.__contains__, 1, 4)


def test_context_kl_known_answer():
    from reprlab.methods.norm_ic.conditions import context_kl

    # window 1 over "a b a c": contexts a->{b, b, c}, b->{a, a}, c->{a}; marginal q = (a 3, b 2, c 1)/6
    kl, n = context_kl([["a", "b", "a", "c"]], ["a", "b", "zz"], window=1)
    q = {"a": 3 / 6, "b": 2 / 6, "c": 1 / 6}
    ref_a = 2 / 3 * math.log((2 / 3) / q["b"]) + 1 / 3 * math.log((1 / 3) / q["c"])
    assert kl[0] == pytest.approx(ref_a)
    assert kl[1] == pytest.approx(math.log(1 / q["a"]))
    assert np.isnan(kl[2]) and n.tolist() == [2, 1, 0]


def test_aggregate_bootstraps_over_documents():
    from reprlab.methods.norm_ic.length import aggregate

    rng = np.random.default_rng(0)
    vals = rng.normal(0.9, 0.05, 40)
    out = aggregate([{"r2_len": v, "undefined": float("nan")} for v in vals], n_boot=2000, ci=0.95, seed=0)
    assert out["r2_len"] == pytest.approx(vals.mean()) and out["r2_len_sd"] == pytest.approx(vals.std())
    assert out["r2_len_lo"] < out["r2_len"] < out["r2_len_hi"]
    # percentile bootstrap of a mean ≈ the normal interval ±1.96·sd/√n; 15% for 2000 resamples of 40 docs
    assert out["r2_len_hi"] - out["r2_len_lo"] == pytest.approx(2 * 1.96 * vals.std() / np.sqrt(40), rel=0.15)
    assert np.isnan(out["undefined"]) and np.isnan(out["undefined_lo"])
    one = aggregate([{"r2_len": 0.5}], n_boot=100)
    assert one["r2_len"] == 0.5 and np.isnan(one["r2_len_lo"]) and np.isnan(one["r2_len_hi"])
