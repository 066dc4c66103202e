import json
from dataclasses import dataclass

import pytest
import torch

from reprlab.errors import CheckpointError
from reprlab.runs import Run, RunExistsError
from reprlab.runs.atomic import atomic_write_json, read_json


@dataclass(frozen=True)
class Cfg:
    seed: int = 0
    width: int = 4


def test_atomic_json_roundtrip_and_errors(tmp_path):
    atomic_write_json(tmp_path / "a" / "x.json", {"t": torch.tensor([1.0, 2.0]), "n": 3})
    assert read_json(tmp_path / "a" / "x.json") == {"t": [1.0, 2.0], "n": 3}
    assert not list((tmp_path / "a").glob(".*tmp"))  # no temp file left behind
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json is not valid JSON"):
        read_json(tmp_path / "bad.json")
    with pytest.raises(FileNotFoundError, match="missing.json"):
        read_json(tmp_path / "missing.json")


def test_checkpoint_roundtrip_restores_weights_optimizer_and_rng(tmp_path):
    run = Run.create(tmp_path / "r", Cfg(), "test")
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    run.save_checkpoint(7, {"model": model}, {"opt": opt}, extra={"note": "x"})
    expected_next = torch.rand(3)  # the draw that follows the checkpoint
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    fresh_opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    step, extra = run.load_checkpoint({"model": model}, {"opt": fresh_opt})
    assert step == 7 and extra == {"note": "x"}
    assert all(torch.equal(model.state_dict()[k], ref[k]) for k in ref)
    assert torch.equal(torch.rand(3), expected_next)  # RNG restored to the checkpoint's state
    assert fresh_opt.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]


def test_keeps_last_two_checkpoints_and_ignores_torn_ones(tmp_path):
    run = Run.create(tmp_path / "r", Cfg(), "test")
    model = torch.nn.Linear(2, 2)
    for s in (1, 2, 3):
        run.save_checkpoint(s, {"model": model})
    (tmp_path / "r" / "checkpoints" / "train" / "step_00000009").mkdir()  # torn: no meta.json
    assert [p.name for p in run.checkpoints()] == ["step_00000002", "step_00000003"]
    assert run.load_checkpoint({"model": model})[0] == 3


def test_corrupt_checkpoint_is_an_error_naming_the_file_and_the_previous_one(tmp_path):
    run = Run.create(tmp_path / "r", Cfg(), "test")
    model = torch.nn.Linear(2, 2)
    run.save_checkpoint(1, {"model": model})
    with torch.no_grad():
        model.weight.add_(1.0)
    path = run.save_checkpoint(2, {"model": model})
    (path / "model.safetensors").write_bytes(b"garbage")
    now = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"step_00000002/model.safetensors has 7 bytes") as err:
        run.load_checkpoint({"model": model})
    assert "--resume-from train/step_00000001" in err.value.hint  # offered, never taken silently
    assert all(torch.equal(model.state_dict()[k], now[k]) for k in now)  # nothing was applied
    assert path.is_dir()  # left where it is, for the user to look at


def test_existing_run_needs_resume_or_overwrite(tmp_path):
    Run.create(tmp_path / "r", Cfg(), "test")
    with pytest.raises(RunExistsError, match="already holds an unfinished run") as err:
        Run.create(tmp_path / "r", Cfg(), "test")
    assert "--resume" in err.value.hint and "--overwrite" in err.value.hint
    with pytest.raises(RunExistsError, match=r"differs .*width: 4 -> 5"):
        Run.create(tmp_path / "r", Cfg(width=5), "test", resume=True)


def test_stage_runs_once_and_resume_truncates_metrics(tmp_path):
    run = Run.create(tmp_path / "r", Cfg(), "test")
    calls = []
    run.log(1, loss=1.0)
    assert run.stage("a", lambda: calls.append(1) or {"x": (1, 2)}) == {"x": [1, 2]}
    run.log(2, loss=0.5)  # logged after the last durable event: dropped on resume
    resumed = Run.create(tmp_path / "r", Cfg(), "test", resume=True)
    assert resumed.stage("a", lambda: calls.append(1) or {"x": 0}) == {"x": [1, 2]}
    assert calls == [1]
    lines = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"step": 1, "loss": 1.0}]


def test_summary_must_be_flat(tmp_path):
    run = Run.create(tmp_path / "r", Cfg(), "test")
    with pytest.raises(TypeError, match="flat"):
        run.write_summary({"a": {"b": 1}})


def test_resume_from_on_another_rank_loads_the_named_checkpoint(tmp_path, monkeypatch):
    """Under torchrun rank 0 sets the later checkpoints aside; a rank that lists first must not pick them."""
    run = Run.create(tmp_path / "r", Cfg(), "test")
    model = torch.nn.Linear(2, 2)
    run.save_checkpoint(1, {"model": model})
    with torch.no_grad():
        model.weight.add_(1.0)
    run.save_checkpoint(2, {"model": model})
    run.close(success=False)
    monkeypatch.setenv("RANK", "1")
    other = Run.create(tmp_path / "r", Cfg(), "test", resume=True, resume_from="train/step_00000001")
    assert other.load_checkpoint({"model": model})[0] == 1
    assert other.load_checkpoint({"model": model})[0] == 2  # later loads (evaluation) take the newest again
