"""Null baselines on planted data: a count-driven correlation must not survive, a planted one must.

The words have 1–4 subword pieces and an IC that grows with the piece count (as real rare words split into
more pieces), so ‖Σ pieces‖² correlates with IC even for vectors that carry nothing about the word. Every
number is checked against an independent answer: the random-vector null against ρ(IC, count) (for N(0, I/d)
pieces E‖Σᵢ rᵢ‖² = k exactly), the shuffled interval against the permutation distribution's ±1.96/√(n−1).
"""

import math

import numpy as np
import pytest
import torch
from scipy import stats as sps

from reprlab.methods.norm_ic.conditions import PairPMI
from reprlab.methods.norm_ic.nulls import null_test, random_piece_vectors, shuffle_interval, survival
from reprlab.methods.norm_ic.recipe import AnalysisConfig, analyse_words
from reprlab.methods.norm_ic.sources import ItemSet

N, D, VOCAB = 800, 256, 1500
ACFG = AnalysisConfig(compositions=("sum", "ind", "mean"), n_boot=300, n_perm=1000)
NO_PAIRS = PairPMI(np.zeros(0, int), np.zeros(0, int), np.zeros(0), np.zeros(0))


def _words(seed: int, n: int, planted: bool):
    """Items of ``n`` words; IC = piece count + noise. ``planted``: piece norms² sum to the word's IC."""
    rng = np.random.default_rng(seed)
    k = rng.integers(1, 5, n)
    ic = k + rng.normal(0, 1.5, n) + 8.0
    pos = 4
    mask = torch.arange(pos)[None] < torch.as_tensor(k)[:, None]
    ids = torch.as_tensor(rng.integers(0, VOCAB, (n, pos))).masked_fill(~mask, -1)
    g = torch.Generator().manual_seed(seed + 99)
    x = torch.randn(n, pos, D, generator=g, dtype=torch.float64) / math.sqrt(D)  # the "model": no information
    if planted:  # random directions, squared norms IC/k each: Σ‖xᵢ‖² = IC exactly, ‖Σxᵢ‖² ≈ IC
        x = x / x.norm(dim=-1, keepdim=True) * torch.sqrt(torch.as_tensor(ic / k))[:, None, None]
    x = x * mask[..., None]
    items = ItemSet(x.float(), mask, torch.full((n, pos), 1e-4), ids=ids)
    return items, ic, k


@pytest.mark.parametrize("planted", [False, True])
def test_planted_signal_survives_and_count_artefact_does_not(planted):
    ev, ic, k = _words(0, N, planted)
    fit, _, _ = _words(1, 400, planted)
    rows, _ = analyse_words("toy", ev, fit, ic, np.zeros(N, int), np.full(400, 1e-4), ACFG.compositions,
                            ("raw",), ACFG, NO_PAIRS, seed=0)  # fmt: skip
    by = {r["composition"]: r for r in rows}
    rho_count = sps.spearmanr(ic, k).statistic
    # independent oracle for the random-vector null: ‖Σ rᵢ‖² ≈ k for N(0, I/d) pieces, so its ρ ≈ ρ(IC, k);
    # 0.06: the χ²-noise of ‖Σ rᵢ‖² at d = 256 breaks some count ties (measured 0.02–0.04)
    assert by["sum"]["null_random"] == pytest.approx(rho_count, abs=0.06)
    assert by["sum"]["piece_count_spearman"] == pytest.approx(rho_count, abs=1e-12)
    # the shuffled interval: permutation distribution of ρ, ≈ ±1.96/√(n−1); 10% for 1000 shuffles
    half = 1.96 / math.sqrt(N - 1)
    assert by["sum"]["null_shuffle_hi"] == pytest.approx(half, rel=0.1)
    assert by["sum"]["null_shuffle_lo"] == pytest.approx(-half, rel=0.1)
    if planted:
        for comp in ("sum", "ind"):
            assert by[comp]["spearman"] > 0.9, comp
            assert by[comp]["verdict"] == 1 and by[comp]["failed"] == "", by[comp]
    else:
        # ρ(sum) is well above chance (it passes the shuffled-IC null) but random pieces and the count explain it
        assert by["sum"]["spearman"] > by["sum"]["null_shuffle_hi"] + 0.2
        assert by["sum"]["verdict"] == 0
        assert "random vectors" in by["sum"]["failed"] and "piece count" in by["sum"]["failed"]
        assert "shuffled IC" not in by["sum"]["failed"]


def test_random_piece_vectors_depend_on_id_only():
    a = random_piece_vectors(torch.tensor([[5, 7, -1]]), 16, seed=3)
    b = random_piece_vectors(torch.tensor([[7], [5]]), 16, seed=3)
    torch.testing.assert_close(a[0, 0], b[1, 0], rtol=0, atol=0)  # same id, same vector, any id set
    torch.testing.assert_close(a[0, 1], b[0, 0], rtol=0, atol=0)
    assert a[0, 2].abs().sum() == 0  # padding
    assert not torch.equal(a[0, 0], random_piece_vectors(torch.tensor([[5]]), 16, seed=4)[0, 0])
    unit = random_piece_vectors(torch.tensor([[1, 2, 3]]), 16, seed=0, kind="unit")
    torch.testing.assert_close(unit.norm(dim=-1), torch.ones(1, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="null vectors"):
        random_piece_vectors(torch.tensor([[1]]), 4, 0, kind="sphere")


def test_null_test_undefined_nulls_and_negative_direction():
    rng = np.random.default_rng(0)
    ic = rng.normal(size=300)
    sq = -ic + rng.normal(0, 0.3, 300)  # strong negative relation, no count, no random analogue
    shuffle = shuffle_interval(300, 500, 0.95, 0)
    r = null_test(ic, sq, None, np.ones(300), shuffle, 200, 0.95, 0)
    assert np.isnan(r.random) and np.isnan(r.count) and r.verdict == -1 and r.failed == ""
    assert r.spearman == pytest.approx(sps.spearmanr(ic, sq).statistic)
    # a null that explains the negative relation removes it
    r2 = null_test(ic, sq, sq + rng.normal(0, 1e-3, 300), None, shuffle, 200, 0.95, 0)
    assert r2.verdict == 0 and r2.failed == "random vectors"
    assert survival({**r.to_dict(), "spearman": float("nan")} | {"shuffle_lo": 0, "shuffle_hi": 0}) == (
        0,
        "undefined",
    )


def test_partial_spearman_given_count():
    """ρ(IC, ‖v‖² | count) against the textbook partial-correlation formula on ranks, and on the planted data."""
    from reprlab.methods.norm_ic.nulls import partial_spearman

    rng = np.random.default_rng(2)
    x, z = rng.normal(size=500), rng.integers(1, 5, 500).astype(float)
    y = z + 0.5 * x + rng.normal(size=500)
    r = lambda a, b: sps.spearmanr(a, b).statistic  # noqa: E731
    ref = (r(x, y) - r(x, z) * r(y, z)) / math.sqrt((1 - r(x, z) ** 2) * (1 - r(y, z) ** 2))
    assert partial_spearman(x, y, z) == pytest.approx(ref, abs=1e-12)  # same algebra: exact up to rounding
    for planted in (False, True):
        ev, ic, k = _words(0, N, planted)
        fit, _, _ = _words(1, 400, planted)
        rows, _ = analyse_words("toy", ev, fit, ic, np.zeros(N, int), np.full(400, 1e-4), ("sum",), ("raw",), ACFG,
                                NO_PAIRS, seed=0)  # fmt: skip
        row = rows[0]
        assert row["null_count_partial_lo"] <= row["null_count_partial"] <= row["null_count_partial_hi"]
        # random pieces carry nothing about IC among equal-count words: ±0.1 ≈ 3 standard errors at n = 800
        assert abs(row["null_random_partial"]) < 0.1
        if planted:  # the planted norm carries IC within words of equal piece count
            assert row["null_count_partial_lo"] > 0.5
        else:  # random pieces: nothing about IC beyond the count
            assert row["null_count_partial_lo"] < 0 < row["null_count_partial_hi"]


def test_normalised_rows_get_a_normalised_random_null():
    """The random-piece null of a whitened row is whitened on the random fit set (recomputed by hand here)."""
    from reprlab.methods.norm_ic.compose import compose, fit_context
    from reprlab.methods.norm_ic.normalize import fit_normalizer

    ev, ic, _ = _words(0, 300, planted=False)
    fit, _, _ = _words(1, 600, planted=False)
    p_fit = np.full(600, 1e-4)
    acfg = AnalysisConfig(compositions=("sum",), n_boot=50, n_perm=200)
    rows, _ = analyse_words("toy", ev, fit, ic, np.zeros(300, int), p_fit, ("sum",), ("raw", "whiten_uniform"), acfg,
                            NO_PAIRS, seed=0)  # fmt: skip
    by = {r["normalization"]: r for r in rows}
    r_ev = random_piece_vectors(ev.ids, D, 0).float()
    r_fit = random_piece_vectors(fit.ids, D, 0).float()
    ctx = fit_context(r_fit, fit.mask, fit.p)
    v_ev = compose("sum", r_ev, ev.mask).double()
    v_fit = compose("sum", r_fit, fit.mask, mu=ctx.mu).double()
    w = fit_normalizer("whiten_uniform", v_fit, torch.from_numpy(p_fit))
    ref = sps.spearmanr(ic, (w(v_ev) ** 2).sum(-1).numpy()).statistic
    assert by["whiten_uniform"]["null_random"] == pytest.approx(ref, abs=1e-12)
    assert by["raw"]["null_random"] == pytest.approx(
        sps.spearmanr(ic, (v_ev**2).sum(-1).numpy()).statistic, abs=1e-12
    )
    assert abs(by["whiten_uniform"]["null_random"] - by["raw"]["null_random"]) > 1e-3  # whitening did act
    assert by["whiten_uniform"]["verdict"] in (-1, 0, 1)


def test_constant_norms_get_no_verdict_rather_than_explained_by_a_null():
    """A CLS state no word can change has constant norms and no ρ: its verdict is undefined (null in summary.json,
    with its reason; n/a in the report), not "does not survive", which would read as a null explaining it."""
    from reprlab.jsonfile import with_null_reasons
    from reprlab.methods.norm_ic.recipe import Config, build_summary, null_reasons
    from reprlab.methods.norm_ic.report import _verdict_text

    nan = float("nan")
    row = {"source": "enc_L0", "composition": "pooled", "normalization": "raw", "n": 10, "verdict": 0,
           "failed": "undefined", "null_random": nan, "piece_count_spearman": 0.3, "null_shuffle_lo": -0.1,
           "null_shuffle_hi": 0.1, "null_random_partial": nan,
           **{f"{s}{b}": nan for s in ("spearman", "pearson") for b in ("", "_lo", "_hi")}, "r2": nan,
           **{f"null_{t}_diff_{b}": nan for t in ("random", "count") for b in ("lo", "hi")},
           **{f"null_count_partial{b}": nan for b in ("", "_lo", "_hi")}}  # fmt: skip
    summary = build_summary(Config(), {}, [row])
    assert np.isnan(summary["enc_L0.pooled.verdict"])
    written = with_null_reasons(summary, null_reasons(summary))
    assert (
        written["enc_L0.pooled.verdict"] is None
        and "constant norms" in written["enc_L0.pooled.verdict.null_reason"]
    )
    assert _verdict_text(row).startswith("n/a (constant norms")
    assert (
        _verdict_text({**row, "failed": "shuffled IC", "spearman": 0.05}) == "does not survive (shuffled IC)"
    )
