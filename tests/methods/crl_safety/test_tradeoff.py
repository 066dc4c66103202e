"""The trade-off plot's points: means and Wilson intervals over seeds, folders read the way sweeps lay them out."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from scipy import stats

from reprlab.errors import DataError
from reprlab.methods.crl_safety import tradeoff

ROOT = Path(__file__).resolve().parents[3]
KEYS = ("asr_prefill", "asr_embedding", "benign_compliance", "over_refusal")


def _summary(**per_model) -> dict:
    return {f"{m}.{k}": v for m, vals in per_model.items() for k, v in zip(KEYS, vals)}


def _write(folder: Path, summary: dict) -> Path:
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps(summary))
    return folder


def test_one_run_gives_bare_means_of_the_models_it_has():
    pts = tradeoff.points_from_summaries([_summary(refusal=(0.9, 1.0, 0.8, 0.25), crl=(0.0, 0.1, 0.7, 0.5))])
    assert [p.model for p in pts] == ["refusal", "crl"]  # rr, crl_adv, base absent: no point, no error
    crl = pts[1].values
    assert (crl["asr_embedding"].mean, crl["over_refusal"].mean) == (0.1, 0.5)
    assert crl["benign_compliance"].lo is None and pts[1].n_seeds == 1


def test_seed_interval_is_wilson_at_the_effective_sample_size():
    """Known answer: values 0, 0.5, 1 -> mean 0.5, sd 0.5, n_eff = p(1-p) n / sd^2 = 3, z = t(0.975, df 2)."""
    runs = [_summary(crl=(v, 0.0, 1.0, 0.0)) for v in (0.0, 0.5, 1.0)]
    v = tradeoff.points_from_summaries(runs)[0].values["asr_prefill"]
    z, n, p = stats.t.ppf(0.975, 2), 3.0, 0.5
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    assert v.mean == pytest.approx(0.5)
    assert (v.lo, v.hi) == pytest.approx((centre - half, centre + half), abs=1e-9)


def test_folders_run_sweep_and_seed_runs(tmp_path):
    a = _write(tmp_path / "sw" / "seed-0", _summary(crl=(0.0, 0.0, 1.0, 0.0)))
    b = _write(tmp_path / "sw" / "seed-1", _summary(crl=(1.0, 1.0, 0.0, 1.0)))
    # an aggregate folder beside the seeds holds means: it is not a third seed
    agg = _write(tmp_path / "sw" / "agg", _summary(crl=(0.5, 0.5, 0.5, 0.5)))
    (agg / "aggregate.json").write_text(json.dumps({"runs": [str(a), str(b)]}))
    for folder in (tmp_path / "sw", agg):
        (p,) = tradeoff.points_from_folder(folder, "32")
        assert (p.n_seeds, p.setting, p.values["asr_prefill"].mean) == (2, "32", 0.5)
    (p,) = tradeoff.points_from_folder(a)
    assert p.n_seeds == 1
    with pytest.raises(DataError, match="no summary.json"):
        tradeoff.points_from_folder(tmp_path / "empty")
    (agg / "aggregate.json").write_text(json.dumps({"runs": [str(tmp_path / "gone")]}))
    with pytest.raises(DataError, match="without summary.json"):
        tradeoff.points_from_folder(agg)


def test_strength_sweep_script_table_and_figure(tmp_path):
    for steps, asr in (("8", 0.8), ("32", 0.0)):
        for s in range(2):
            _write(
                tmp_path / steps / f"seed-{s}",
                _summary(refusal=(0.9, 0.9, 0.9, 0.2), crl=(asr, asr, 0.8, 0.3)),
            )
    fig = tmp_path / "t.png"
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "crl_tradeoff.py"), "--point", f"8={tmp_path / '8'}",
                          "--point", f"32={tmp_path / '32'}", "--figure", str(fig)],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    rows = [line for line in out.splitlines() if line.startswith("| CRL |")]
    assert [r.split("|")[2].strip() for r in rows] == ["8", "32"]
    assert rows[0].split("|")[4].strip().startswith("0.80") and fig.stat().st_size > 0
    assert (
        rows[0].split("|")[8].strip() == "–"
    )  # no degenerate share in these summaries: no answers column value
    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "crl_tradeoff.py"), "--point", f"x={tmp_path}/nope"],
                         capture_output=True, text=True)  # fmt: skip
    assert bad.returncode == 2 and "nope" in bad.stderr


def test_xstest_answers_stored_or_derived_from_the_refuse_and_degenerate_shares():
    """A model that turns safe prompts into degenerate text has low over-refusal and few answers: the third column
    shows it. Summaries from before the key give it as 1 - refused - degenerate (the claims' identity)."""
    old = _summary(refusal=(0.9, 1.0, 0.9, 0.25), crl=(0.0, 0.0, 0.9, 0.05))
    old.update({"refusal.xstest_degenerate": 0.0, "crl.xstest_degenerate": 0.70})
    new = {**old, "crl.xstest_compliance": 0.30, "refusal.xstest_compliance": 0.75}
    for s in (old, new):
        ref, crl = tradeoff.points_from_summaries([s])
        assert crl.values["xstest_compliance"].mean == pytest.approx(0.25 if s is old else 0.30)
        assert ref.values["xstest_compliance"].mean == pytest.approx(0.75)
    # without the degenerate share the column is absent, the point is not
    (p,) = tradeoff.points_from_summaries([_summary(crl=(0.0, 0.0, 0.9, 0.05))])
    assert "xstest_compliance" not in p.values and p.values["over_refusal"].mean == 0.05


def test_figure_has_a_third_column_only_with_answers(tmp_path):
    from reprlab.report.figures import pyplot

    s = _summary(refusal=(0.9, 1.0, 0.9, 0.25), crl=(0.0, 0.0, 0.9, 0.05))
    plt = pyplot()
    fig = tradeoff.figure(tradeoff.points_from_summaries([s]), plt)
    assert len(fig.axes) == 4
    s.update({"refusal.xstest_degenerate": 0.0, "crl.xstest_degenerate": 0.70})
    fig = tradeoff.figure(tradeoff.points_from_summaries([s]), plt)
    assert len(fig.axes) == 6 and fig.axes[2].get_xlabel() == "XSTest-style answered"
    rows = tradeoff.table(tradeoff.points_from_summaries([s]))
    assert rows[1]["xstest_compliance"] == pytest.approx(0.25)
    assert "setting" not in rows[0]  # one run's points have no setting: no empty column
    assert tradeoff.table(tradeoff.points_from_summaries([s], "32"))[0]["setting"] == "32"
    plt.close("all")
