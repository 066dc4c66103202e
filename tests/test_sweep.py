"""Seed sweeps end to end on smoke-digits: per-seed run folders, aggregate keys checked against scipy,
skip/resume, `reprlab aggregate` rebuilding the same summary, and the submitit local launcher."""

import json

import numpy as np
import pytest
from scipy import stats
from typer.testing import CliRunner

from reprlab.cli import app
from reprlab.errors import ReprlabError, RunFolderError
from reprlab.sweep import aggregate_folders, parse_seeds, run_sweep

FAST = ["train.epochs=2"]
runner = CliRunner()


def _read(p):
    return json.loads(p.read_text())


def _no_time(summary):
    return {k: v for k, v in summary.items() if not k.startswith("wall_time_s")}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    import torch

    out = tmp_path_factory.mktemp("sw") / "s"
    threads = torch.get_num_threads()
    torch.set_num_threads(
        1
    )  # module fixtures run outside the suite's one-thread fixture; fix it for bit-equality
    try:
        result = runner.invoke(
            app, ["run", "smoke-digits", "--seeds", "0,1,2", "--out", str(out), "-q", *FAST]
        )
    finally:
        torch.set_num_threads(threads)
    assert result.exit_code == 0, result.output
    return out


def test_one_ordinary_run_folder_per_seed(sweep):
    for s in (0, 1, 2):
        d = sweep / f"seed-{s}"
        assert (d / "summary.json").is_file() and (d / "report.html").is_file()
        assert f"seed: {s}" in (d / "config.yaml").read_text()
    accs = [_read(sweep / f"seed-{s}" / "summary.json")["test_acc"] for s in (0, 1, 2)]
    assert len(set(accs)) > 1  # the seeds really differ


def test_aggregate_keys_against_scipy(sweep):
    agg = _read(sweep / "summary.json")
    accs = [_read(sweep / f"seed-{s}" / "summary.json")["test_acc"] for s in (0, 1, 2)]
    losses = [_read(sweep / f"seed-{s}" / "summary.json")["final_loss"] for s in (0, 1, 2)]
    lo, hi = stats.t.interval(0.95, 2, loc=np.mean(losses), scale=stats.sem(losses))  # continuous: t
    assert agg["final_loss"] == pytest.approx(np.mean(losses), abs=1e-12)
    assert agg["final_loss.ci_lo"] == pytest.approx(lo, abs=1e-12) and agg[
        "final_loss.ci_hi"
    ] == pytest.approx(hi)
    assert agg["final_loss.ci_method"] == "student-t"
    # test_acc is declared a proportion: Wilson's score interval at n_eff = p(1-p)·n/s², t quantile, in [0, 1]
    p, n, sd = np.mean(accs), 3, np.std(accs, ddof=1)
    n_eff, t = p * (1 - p) * n / sd**2, stats.t.ppf(0.975, n - 1)
    centre, half = (p + t**2 / (2 * n_eff)) / (1 + t**2 / n_eff), t / (1 + t**2 / n_eff) * np.sqrt(
        p * (1 - p) / n_eff + t**2 / (4 * n_eff**2))  # fmt: skip
    assert agg["test_acc"] == pytest.approx(p, abs=1e-12) and agg["test_acc.ci_method"] == "wilson-eff"
    assert agg["test_acc.ci_lo"] == pytest.approx(centre - half) and agg["test_acc.ci_hi"] == pytest.approx(
        centre + half
    )
    assert 0 <= agg["test_acc.ci_lo"] <= p <= agg["test_acc.ci_hi"] <= 1
    assert agg["test_acc.n"] == 3 and agg["seeds.n"] == 3
    per_seed = [_read(sweep / f"seed-{s}" / "summary.json")["claims.learns"] for s in (0, 1, 2)]
    assert agg["claims.learns"] == pytest.approx(np.mean(per_seed))  # share of seeds on which it held
    assert agg["claims.learns.ci_method"] == "wilson"
    assert agg["claims_on_mean.learns"] == int(np.mean(accs) >= 0.85)  # the claim evaluated on the mean
    claims = _read(sweep / "claims.json")["claims"]
    assert {c["claim"] for c in claims} == {"learns", "loss_below_chance"}
    assert claims[0]["holds on seeds"]["mean"] == pytest.approx(np.mean(per_seed))
    assert claims[0]["holds on seeds"]["n"] == 3
    md = (sweep / "report.md").read_text()
    assert "Every metric over seeds" in md and "seed 2" in md and "Claims and headline results" in md
    assert "mean [95% interval] over 3 seeds" in md  # the curated headline with its interval


def test_reprlab_aggregate_rebuilds_the_same_summary(sweep, tmp_path):
    result = runner.invoke(app, ["aggregate", *(str(sweep / f"seed-{s}") for s in (0, 1, 2)),
                                 "--out", str(tmp_path / "agg")])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert _no_time(_read(tmp_path / "agg" / "summary.json")) == _no_time(_read(sweep / "summary.json"))
    aggregate_folders([sweep])  # a sweep folder alone aggregates into itself
    assert (sweep / "report.html").is_file()
    # one run folder alone has no place for an aggregate: the message says so, not "several folders"
    result = runner.invoke(app, ["aggregate", str(sweep / "seed-0")])
    assert result.exit_code == 2 and "a run folder given: pass --out" in result.output, result.output


def test_aggregate_names_its_runs_so_they_are_found_from_anywhere(sweep, tmp_path, monkeypatch):
    """aggregate.json names a sweep's own seeds relative to the sweep (it moves as one) and other runs by their
    absolute paths, so a report rebuilt from another directory still finds them (the command's relative names
    held only from where it ran); an older file's cwd-relative names still read."""
    import shutil

    from reprlab.results.aggregate import aggregated_runs

    moved = tmp_path / "project" / "moved"
    shutil.copytree(sweep, moved)
    assert _read(moved / "aggregate.json")["runs"] == ["seed-0", "seed-1", "seed-2"]
    assert [p.name for p in aggregated_runs(moved, _read(moved / "aggregate.json"))] == [
        "seed-0",
        "seed-1",
        "seed-2",
    ]
    monkeypatch.chdir(tmp_path / "project")
    result = runner.invoke(app, ["aggregate", "moved/seed-0", "moved/seed-1", "--out", "agg"])
    assert result.exit_code == 0, result.output
    agg = tmp_path / "project" / "agg"
    want = [str(moved / f"seed-{s}") for s in (0, 1)]
    assert _read(agg / "aggregate.json")["runs"] == want
    monkeypatch.chdir(tmp_path)
    assert [str(p) for p in aggregated_runs(agg, _read(agg / "aggregate.json"))] == want
    (agg / "report.md").unlink()
    result = runner.invoke(app, ["report", str(agg)])  # rebuilt from another directory
    assert result.exit_code == 0 and "seed-1" in (agg / "report.md").read_text(), result.output
    # the form written before: relative to the directory the aggregate ran in
    old = {"runs": ["project/moved/seed-0", "project/moved/seed-1"]}
    assert [str(p.resolve()) for p in aggregated_runs(tmp_path / "elsewhere", old)] == want


def test_aggregate_out_never_writes_among_files_it_does_not_own(sweep, tmp_path):
    """--out must be new, empty, or an earlier aggregate: a folder of the user's files and the sweep of
    `reprlab run --seeds` given runs other than its own seeds are refused, and nothing in them changes."""
    import shutil

    seeds = [str(sweep / f"seed-{s}") for s in (0, 1)]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "summary.json").write_text('{"mine": 1}')
    result = runner.invoke(app, ["aggregate", *seeds, "--out", str(mine)])
    assert result.exit_code == 2 and "not a reprlab aggregate" in result.output, result.output
    assert (mine / "summary.json").read_text() == '{"mine": 1}'
    other = tmp_path / "other-sweep"
    shutil.copytree(sweep, other)
    before = (other / "summary.json").read_bytes()
    result = runner.invoke(app, ["aggregate", *seeds, "--out", str(other)])
    assert result.exit_code == 2 and "seed sweep of `reprlab run --seeds`" in result.output, result.output
    assert (other / "summary.json").read_bytes() == before
    # its own seeds are welcome (the aggregate is rebuilt in place), and so is an earlier aggregate
    result = runner.invoke(
        app, ["aggregate", *(str(other / f"seed-{s}") for s in (0, 1, 2)), "--out", str(other)]
    )
    assert result.exit_code == 0, result.output
    agg = tmp_path / "agg"
    for given in (seeds, [*seeds, str(sweep / "seed-2")]):
        result = runner.invoke(app, ["aggregate", *given, "--out", str(agg)])
        assert result.exit_code == 0, result.output
        assert len(_read(agg / "sweep.json")["aggregated_from"]) == len(given)  # the marker follows the runs


def test_aggregate_judges_each_seed_by_the_claims_as_declared_now(sweep, tmp_path):
    # a folder written under an older wording of a claim stores that wording's verdict; the aggregate's "holds on
    # seeds" must judge the claim it prints, so it re-evaluates each seed from the seed's own metrics
    import shutil

    folders = []
    for s in (0, 1, 2):
        d = tmp_path / f"seed-{s}"
        shutil.copytree(sweep / f"seed-{s}", d)
        summary = _read(d / "summary.json")
        summary["claims.learns"] = 1 - summary["claims.learns"]  # a stale verdict
        (d / "summary.json").write_text(json.dumps(summary))
        folders.append(d)
    aggregate_folders(folders, tmp_path / "agg")
    agg = _read(tmp_path / "agg" / "summary.json")
    accs = [_read(sweep / f"seed-{s}" / "summary.json")["test_acc"] for s in (0, 1, 2)]
    assert agg["claims.learns"] == pytest.approx(np.mean([a >= 0.85 for a in accs]))
    held = _read(tmp_path / "agg" / "claims.json")["claims"][0]["holds on seeds"]["mean"]
    assert held == pytest.approx(np.mean([a >= 0.85 for a in accs]))


def test_aggregate_refuses_other_settings_naming_the_difference(sweep, tmp_path):
    from reprlab.runner import execute

    other = execute("smoke-digits", ["train.epochs=1", "seed=7"], tmp_path / "other", quiet=True)
    result = runner.invoke(
        app, ["aggregate", str(sweep / "seed-0"), str(other), "--out", str(tmp_path / "x")]
    )
    assert (
        result.exit_code == 2 and "train.epochs: 2 -> 1" in result.output and "Traceback" not in result.output
    )


def test_finished_seeds_are_skipped_and_new_ones_added_on_resume(sweep):
    before = (sweep / "seed-0" / "summary.json").stat().st_mtime_ns
    run_sweep("smoke-digits", [0, 3], FAST, sweep, resume=True, quiet=True)
    assert (sweep / "seed-0" / "summary.json").stat().st_mtime_ns == before
    assert (sweep / "seed-3" / "summary.json").is_file()
    assert _read(sweep / "summary.json")["test_acc.n"] == 4  # 0,1,2 from before plus 3
    with pytest.raises(RunFolderError, match="already holds a seed sweep"):
        run_sweep("smoke-digits", [0], FAST, sweep, quiet=True)
    with pytest.raises(RunFolderError, match="not smoke-digits with"):
        run_sweep("smoke-digits", [0], ["train.epochs=1"], sweep, resume=True, quiet=True)


def test_interrupted_seed_is_resumed_to_the_uninterrupted_result(tmp_path, monkeypatch, sweep):
    monkeypatch.setenv("REPRLAB_SMOKE_STOP_AFTER", "30")  # every seed dies at step 30
    with pytest.raises(ReprlabError, match="2 of 2 seeds failed"):
        run_sweep("smoke-digits", [0, 1], [*FAST, "train.checkpoint_every=10"], tmp_path / "s", quiet=True)
    monkeypatch.delenv("REPRLAB_SMOKE_STOP_AFTER")
    with pytest.raises(RunFolderError, match="already holds a seed sweep"):  # finishing it needs --resume
        run_sweep("smoke-digits", [0, 1], [*FAST, "train.checkpoint_every=10"], tmp_path / "s", quiet=True)
    out = run_sweep(
        "smoke-digits", [0, 1], [*FAST, "train.checkpoint_every=10"], tmp_path / "s", resume=True, quiet=True
    )
    ref = run_sweep(
        "smoke-digits", [0, 1], [*FAST, "train.checkpoint_every=10"], tmp_path / "ref", quiet=True
    )
    assert _no_time(_read(out / "summary.json")) == _no_time(_read(ref / "summary.json"))


def test_seed_override_and_bad_seeds_are_input_errors(tmp_path):
    result = runner.invoke(
        app, ["run", "smoke-digits", "--seeds", "0,1", "seed=3", "--out", str(tmp_path / "a")]
    )
    assert result.exit_code == 2 and "drop seed=" in result.output
    result = runner.invoke(app, ["run", "smoke-digits", "--seeds", "0,x", "--out", str(tmp_path / "a")])
    assert result.exit_code == 2 and "--seeds" in result.output
    assert parse_seeds("0-2,5") == [0, 1, 2, 5]
    assert not (tmp_path / "a").exists()


def test_submitit_local_launcher_matches_inline(tmp_path, sweep, monkeypatch):
    pytest.importorskip("submitit")
    # bit-equality needs equal thread counts: the in-process sweep ran with the suite's one intra-op thread
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = run_sweep("smoke-digits", [0, 1], FAST, tmp_path / "sub", quiet=True, launcher="submitit-local",
                    launcher_opts={"timeout_min": 10})  # fmt: skip
    for s in (0, 1):  # each seed ran as its own job, in its own process, into an ordinary run folder
        assert _no_time(_read(out / f"seed-{s}" / "summary.json")) == _no_time(
            _read(sweep / f"seed-{s}" / "summary.json")
        )
    assert list((out / "submitit").iterdir())  # submitit's job folders (logs, pickles)
