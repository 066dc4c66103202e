"""End-to-end recipe runs on tiny settings (slow on the shared 2-core machine, so marked slow)."""

import json
import math

import pytest

from reprlab.cli import execute

FDA_TINY = ["train.steps=40", "train.eval_every=20", "task.n_train=400", "task.n_test=100",
            "analysis.probe_items=200", "analysis.circuit_items=20", "model.d_model=32", "model.d_mlp=64"]
SUMMARY_KEYS = ["clean_test_em", "noisy_memorized", "noisy_true_answer", "probe_carry_acc_clean",
                "probe_carry_acc_noisy", "inlp_memorization_drop", "inlp_random_drop", "circuit_iou",
                "neuron_patch_restore_rate"]


@pytest.mark.slow
def test_fda_recipe_end_to_end_and_resume(tmp_path):
    out = execute("rote-fda-tiny", FDA_TINY, out=tmp_path / "run", quiet=True)
    summary = json.loads((out / "summary.json").read_text())
    for key in SUMMARY_KEYS:
        assert key in summary and math.isfinite(summary[key]), key
    for name in ("logit_lens", "probes", "inlp", "circuits", "neurons"):
        assert (out / "analysis" / f"{name}.json").exists()
    assert (out / "report.md").exists()
    # resuming a finished run reads every stage back and reproduces the summary
    again = execute("rote-fda-tiny", FDA_TINY, out=tmp_path / "run", resume=True, quiet=True)
    summary2 = json.loads((again / "summary.json").read_text())
    assert {k: summary2[k] for k in SUMMARY_KEYS} == {k: summary[k] for k in SUMMARY_KEYS}


@pytest.mark.slow
def test_thr_recipe_end_to_end(tmp_path):
    out = execute("rote-thr-tiny", ["train.steps=20", "train.eval_every=10", "task.n_people=30", "task.n_orgs=6"],
                  out=tmp_path / "thr", quiet=True)
    summary = json.loads((out / "summary.json").read_text())
    for key in ("heldout_two_hop_em", "facts_em", "noisy_memorized", "probe_bridge_acc_noisy", "inlp_memorization_drop"):
        assert key in summary, key
