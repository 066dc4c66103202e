"""Intervals over seeds by declared kind: Wilson inside [0, 1] for proportions and claim shares, t otherwise."""

import math

import numpy as np
import pytest
from scipy import stats

from reprlab.results.intervals import interval, kind_of, wilson_bounds


def test_wilson_known_answers():
    # 0 of 10 at z=1.96: the upper bound is z²/(n+z²) (Wilson 1927; Agresti & Coull 1998, table 1 setting)
    z = stats.norm.ppf(0.975)
    lo, hi = wilson_bounds(0.0, 10, z)
    assert lo == 0.0 and hi == pytest.approx(z**2 / (10 + z**2))
    # 1 of 2: symmetric about 1/2
    lo, hi = wilson_bounds(0.5, 2, z)
    assert lo + hi == pytest.approx(1.0)


def test_an_asr_of_0_025_over_ten_seeds_stays_inside_0_1():
    asr = [0.0] * 9 + [0.25]  # one seed at 10/40 attacked items, nine at 0: mean 0.025
    t = interval(asr, "continuous")
    assert t.lo < 0  # what the t interval gave (the README's [-0.032, 0.082])
    w = interval(asr, "proportion")
    assert w.method == "wilson-eff" and 0.0 <= w.lo < 0.025 < w.hi <= 1.0
    assert w.mean == pytest.approx(0.025)


def test_proportion_interval_matches_t_away_from_the_bounds():
    # near 0.5 with a small spread the effective n is large and Wilson tends to the t interval
    vals = [0.49, 0.50, 0.51, 0.50, 0.505]
    w, t = interval(vals, "proportion"), interval(vals, "continuous")
    assert w.lo == pytest.approx(t.lo, abs=2e-4) and w.hi == pytest.approx(t.hi, abs=2e-4)


def test_t_interval_matches_scipy():
    vals = [1.0, 2.5, 3.0, 7.0]
    t = interval(vals)
    lo, hi = stats.t.interval(0.95, 3, loc=np.mean(vals), scale=stats.sem(vals))
    assert (t.lo, t.hi) == pytest.approx((lo, hi)) and t.method == "student-t"


def test_claim_shares_are_wilson_k_of_n():
    w = interval([1, 1, 0], "share")
    lo, hi = wilson_bounds(2 / 3, 3, stats.norm.ppf(0.975))
    assert (w.lo, w.hi) == pytest.approx((lo, hi)) and w.method == "wilson"
    assert interval([1, 1, 1], "share").hi == 1.0 and interval([1, 1, 1], "share").lo < 1.0


def test_kinds_are_declared_not_guessed():
    kinds = {"*.asr_*": "proportion", "test_acc": "proportion"}
    assert kind_of("none.asr_targeted", kinds) == "proportion"
    assert kind_of("none.loss", kinds) == "continuous"  # a value in [0, 1] is not a proportion by default
    assert kind_of("claims.learns", {}) == "share"
    bad = interval([0.2, 1.4], "proportion")  # a wrong declaration falls back to t and says so
    assert bad.method.startswith("student-t (declared proportion")


def test_one_seed_has_no_interval_and_equal_seeds_a_point():
    assert interval([0.3], "proportion").lo is None
    same = interval([0.2, 0.2, 0.2], "proportion")
    assert same.lo == pytest.approx(0.2) and same.hi == pytest.approx(0.2) and not math.isnan(same.sd)


def test_every_shipped_recipe_declares_valid_kinds():
    from reprlab.recipes import all_recipes

    for name, recipe in all_recipes().items():
        if recipe.method == "otcclip":
            pytest.importorskip("reprlab.methods.otcclip.recipe")
        assert isinstance(recipe.summary_kinds(), dict), name
