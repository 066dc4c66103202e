"""Stage 0's label against a defence's, prompt by prompt (``crl_safety/transitions.py``), on run folders written by
hand: known counts over two seeds, shares of a known answer, and clear errors for a missing stage or other prompts.
Checked by breaking it on purpose: the pairs zipped the other way round (defence, stage 0) -> the counts fail."""

import json

import pytest

from reprlab.errors import RunFolderError
from reprlab.methods.crl_safety.transitions import label_pairs, shares


def _run(path, base_labels, model_labels, prompts=None):
    prompts = prompts or [f"p{i}" for i in range(len(base_labels))]
    for name, labels in (("refusal", base_labels), ("crl_adv", model_labels)):
        result = {"prompts": {"benign": prompts}, "benign": {"labels": labels}}
        (path / "stages").mkdir(parents=True, exist_ok=True)
        (path / "stages" / f"eval_{name}.json").write_text(json.dumps({"result": result}))
    return path


def test_pairs_add_up_over_seeds_and_shares_follow(tmp_path):
    a = _run(
        tmp_path / "seed-0",
        ["comply", "comply", "refuse", "refuse"],
        ["degenerate", "comply", "comply", "refuse"],
    )
    b = _run(tmp_path / "seed-1", ["comply", "refuse"], ["refuse", "degenerate"])
    pairs = label_pairs([a, b])
    assert pairs == {
        ("comply", "degenerate"): 1,
        ("comply", "comply"): 1,
        ("comply", "refuse"): 1,
        ("refuse", "comply"): 1,
        ("refuse", "refuse"): 1,
        ("refuse", "degenerate"): 1,
    }
    assert shares(pairs, "comply") == pytest.approx({"comply": 1 / 3, "refuse": 1 / 3, "degenerate": 1 / 3})
    assert shares(pairs, "degenerate") == {}  # stage 0 garbled nothing: no shares, not a division by zero
    only = label_pairs([_run(tmp_path / "one", ["comply", "comply"], ["comply", "degenerate"])])
    assert shares(only, "comply") == {"comply": 0.5, "refuse": 0.0, "degenerate": 0.5}


def test_a_missing_stage_or_other_prompts_are_named(tmp_path):
    run = _run(tmp_path / "r", ["comply"], ["comply"])
    (run / "stages" / "eval_crl_adv.json").unlink()
    with pytest.raises(RunFolderError, match=r"eval_crl_adv\.json is missing"):
        label_pairs([run])
    other = _run(tmp_path / "o", ["comply"], ["comply"])
    stage = other / "stages" / "eval_crl_adv.json"
    data = json.loads(stage.read_text())
    data["result"]["prompts"]["benign"] = ["another prompt"]
    stage.write_text(json.dumps(data))
    with pytest.raises(RunFolderError, match="different benign prompts"):
        label_pairs([other])
