"""End to end through the CLI's execute(): a run interrupted mid-training and resumed ends with exactly the
metrics of an uninterrupted run with the same seed (same losses at every step, same final accuracy)."""

import json

import pytest

from reprlab.cli import execute
from reprlab.methods.smoke.recipe import Interrupted


def _metrics(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_interrupted_then_resumed_equals_uninterrupted(tmp_path, monkeypatch):
    overrides = ["train.epochs=3", "train.checkpoint_every=10"]
    full = execute("smoke-digits", overrides, tmp_path / "full", quiet=True)

    monkeypatch.setenv("REPRLAB_SMOKE_STOP_AFTER", "35")  # dies 5 steps after the step-30 checkpoint
    with pytest.raises(Interrupted):
        execute("smoke-digits", overrides, tmp_path / "cut", quiet=True)
    monkeypatch.delenv("REPRLAB_SMOKE_STOP_AFTER")
    resumed = execute("smoke-digits", overrides, tmp_path / "cut", resume=True, quiet=True)

    assert _metrics(resumed) == _metrics(full)  # bitwise: same data order, RNG and optimizer state
    s_full = json.loads((full / "summary.json").read_text())
    s_res = json.loads((resumed / "summary.json").read_text())
    assert s_res["test_acc"] == s_full["test_acc"] and s_res["final_loss"] == s_full["final_loss"]
    # sanity bound for an MLP on digits after 3 epochs (it reaches ~0.9; chance is 0.1)
    assert s_full["test_acc"] > 0.6
    for name in ("config.yaml", "env.json", "summary.json", "report.html", "report.md"):
        assert (full / name).exists(), name
    html = (full / "report.html").read_text()
    assert "data:image/svg+xml;base64" in html and "test_acc" in html
