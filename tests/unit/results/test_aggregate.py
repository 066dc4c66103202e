"""The sweep statistics against scipy's own t interval, on known values."""

import math

import numpy as np
import pytest
from scipy import stats

from reprlab.errors import RunFolderError
from reprlab.results.aggregate import SeedRun, aggregate_summaries, check_same_setting, t_interval


@pytest.mark.parametrize("values", [[0.9, 0.95, 0.97], [1.0, 2.0], [0.1, 0.5, 0.2, 0.9, 0.3]])
def test_t_interval_matches_scipy(values):
    mean, sd, lo, hi = t_interval(values)
    ref_lo, ref_hi = stats.t.interval(0.95, len(values) - 1, loc=np.mean(values), scale=stats.sem(values))
    assert mean == pytest.approx(np.mean(values), abs=1e-12)
    assert sd == pytest.approx(np.std(values, ddof=1), abs=1e-12)
    assert lo == pytest.approx(ref_lo, abs=1e-12) and hi == pytest.approx(ref_hi, abs=1e-12)


def test_one_value_has_no_interval():
    assert t_interval([0.3]) == (0.3, 0.0, None, None)


def _run(seed, summary, **cfg):
    return SeedRun(
        path=f"/r/seed-{seed}", recipe="r", seed=seed, config={"seed": seed, **cfg}, summary=summary
    )


def test_aggregate_keys_claim_fractions_and_string_keys():
    runs = [
        _run(0, {"acc": 0.8, "claims.ok": 1, "variant": "demo"}),
        _run(1, {"acc": 0.9, "claims.ok": 0, "variant": "demo"}),
        _run(2, {"acc": 1.0, "claims.ok": 1, "variant": "demo", "extra": 5}),
    ]
    flat, detail = aggregate_summaries(runs)
    assert flat["acc"] == pytest.approx(0.9) and flat["acc.n"] == 3
    assert flat["claims.ok"] == pytest.approx(2 / 3)  # the share of seeds on which the claim held
    assert flat["variant"] == "demo" and flat["extra"] == 5 and flat["extra.n"] == 1
    assert detail["acc"]["per_seed"] == {"0": 0.8, "1": 0.9, "2": 1.0}
    assert math.isclose(flat["acc.ci_hi"] - flat["acc"], flat["acc"] - flat["acc.ci_lo"])


def test_runs_of_different_settings_are_refused_naming_the_key():
    with pytest.raises(RunFolderError, match=r"train.lr: 0.1 -> 0.2"):
        check_same_setting([_run(0, {}, train={"lr": 0.1}), _run(1, {}, train={"lr": 0.2})])
    with pytest.raises(RunFolderError, match=r"seed\(s\) \[0\] appear more than once"):
        check_same_setting([_run(0, {}), _run(0, {})])
    check_same_setting(
        [_run(0, {}, train={"lr": 0.1}), _run(1, {}, train={"lr": 0.1})]
    )  # only the seed differs
