"""Checkpoints load without running code: optimizer and RNG state as safetensors + JSON round-trip exactly;
a pickle planted in any checkpoint file is never unpickled (``--resume`` stops with exit 2 and the marker file
the pickle would create never appears); old pickled checkpoints are refused with the conversion command, and
that conversion resumes to the uninterrupted result."""

import copy
import json
import pickle
import random
import shutil

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from reprlab.cli import app
from reprlab.errors import CheckpointError
from reprlab.methods.smoke.recipe import Interrupted
from reprlab.runner import execute
from reprlab.runs import statefile
from reprlab.runs.checkpoint import (
    list_checkpoints,
    load_checkpoint_dir,
    rng_state,
    save_checkpoint_dir,
    sha256_file,
    step_of,
)

FAST = ["train.epochs=1", "train.checkpoint_every=10"]  # 22 steps; checkpoints at 10, 20 and 22
cli = CliRunner()


class _CreatesAFile:
    """Unpickling this creates ``path``: the marker that code from the run folder ran."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_the_planted_payload_is_live(tmp_path):
    """The pickles below would create their marker if anything unpickled them (so those tests can fail)."""
    pickle.loads(pickle.dumps(_CreatesAFile(tmp_path / "a")))
    torch.save(_CreatesAFile(tmp_path / "b"), tmp_path / "x.pt")
    torch.load(tmp_path / "x.pt", weights_only=False)
    assert (tmp_path / "a").exists() and (tmp_path / "b").exists()


def _summary(run_dir):
    s = json.loads((run_dir / "summary.json").read_text())
    s.pop("wall_time_s")
    return s


@pytest.fixture(scope="module")
def runs(tmp_path_factory, one_thread):
    """An uninterrupted run and one killed after step 15 (its newest checkpoint: step 10)."""
    root = tmp_path_factory.mktemp("ckpt")
    full = execute("smoke-digits", FAST, root / "full", quiet=True)
    mp = pytest.MonkeyPatch()
    mp.setenv("REPRLAB_SMOKE_STOP_AFTER", "15")
    with pytest.raises(Interrupted):
        execute("smoke-digits", FAST, root / "cut", quiet=True)
    mp.undo()
    return full, root / "cut"


@pytest.fixture
def cut(runs, tmp_path):
    dst = tmp_path / "cut"
    shutil.copytree(runs[1], dst)
    return dst


def _ckpt(run_dir):
    return run_dir / "checkpoints" / "train" / "step_00000010"


def _reseal(ckpt, name):
    """Update meta.json's manifest for ``name``, as anyone who edits a run folder can."""
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["files"][name] = {"size": (ckpt / name).stat().st_size, "sha256": sha256_file(ckpt / name)}
    (ckpt / "meta.json").write_text(json.dumps(meta))


def test_optimizer_state_round_trips_and_training_continues_bit_for_bit(tmp_path):
    torch.manual_seed(0)
    x, y = torch.randn(32, 5), torch.randn(32, 1)

    def train(model, opt, n):
        for _ in range(n):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    makers = {
        "adamw-amsgrad": lambda p: torch.optim.AdamW(p, lr=1e-2, amsgrad=True),
        "sgd-nesterov": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, nesterov=True),
        "adam-two-groups": lambda p: torch.optim.Adam(
            [{"params": p[:1], "lr": 1e-3}, {"params": p[1:]}], lr=1e-2, betas=(0.8, 0.9)
        ),  # fmt: skip
    }
    for name, make in makers.items():
        model = torch.nn.Linear(5, 1)
        opt = make(list(model.parameters()))
        train(model, opt, 3)
        folder = save_checkpoint_dir(tmp_path / name, 3, {"m": model}, {"o": opt})
        saved = copy.deepcopy(opt.state_dict())  # state_dict() holds the live tensors
        expected = train(model, opt, 3)
        model2 = torch.nn.Linear(5, 1)
        opt2 = make(list(model2.parameters()))
        load_checkpoint_dir(folder, {"m": model2}, {"o": opt2}, restore_rng=False)
        # the state came back through JSON + safetensors whole: groups (tuples included) and every tensor
        assert opt2.state_dict()["param_groups"] == saved["param_groups"], name
        for pid, st in saved["state"].items():
            for k, v in st.items():
                assert torch.equal(opt2.state_dict()["state"][pid][k], v), (name, k)
        # the same update path from the same state: bit for bit
        assert all(torch.equal(a, b) for a, b in zip(train(model2, opt2, 3), expected)), name


def test_rng_states_round_trip_exactly(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.normal()  # leaves numpy's cached second Gaussian in the state (has_gauss=1)
    random.random()
    folder = save_checkpoint_dir(tmp_path, 1, {}, None)
    after = (
        random.random(),
        np.random.normal(size=3).tolist(),
        torch.rand(3).tolist(),
        random.getrandbits(70),
    )
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    load_checkpoint_dir(folder, {})
    again = (
        random.random(),
        np.random.normal(size=3).tolist(),
        torch.rand(3).tolist(),
        random.getrandbits(70),
    )
    assert again == after  # the same generators from the same states: bitwise
    skeleton, tensors = statefile.encode(rng_state())
    assert set(tensors) == {"t0"} and tensors["t0"].dtype == torch.uint8  # torch's state: a uint8 tensor
    json.dumps(skeleton)  # Python's and numpy's states: plain JSON


def test_state_skeleton_refuses_what_it_did_not_write():
    for bad in ({"__import__": "os"}, {"__tensor__": "t9"}, {"__ndarray__": {"dtype": "O", "shape": [1], "data": [1]}},
                {"__tuple__": 3}, {"a": {"__dict__": [[1]]}}):  # fmt: skip
        with pytest.raises(statefile.StateFormatError):
            statefile.decode(bad, {})
    with pytest.raises(statefile.StateFormatError, match="not valid JSON"):
        statefile.loads("[" * 200_000, "x.json")  # deep nesting: an error, not a RecursionError


def test_a_damaged_part_applies_nothing(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    folder = save_checkpoint_dir(tmp_path, 1, {"model": model}, {"opt": opt})
    (folder / "rng.json").write_text('{"python": 1, "numpy": 2, "torch": 3}\n')
    _reseal(folder, "rng.json")
    with torch.no_grad():
        model.weight.add_(1.0)
    weights, state = (
        {k: v.clone() for k, v in model.state_dict().items()},
        opt.state_dict()["state"][0]["step"].clone(),
    )
    torch.manual_seed(5)
    draw = torch.rand(2)
    torch.manual_seed(5)
    with pytest.raises(CheckpointError, match="rng.json"):
        load_checkpoint_dir(folder, {"model": model}, {"opt": opt})
    assert all(torch.equal(model.state_dict()[k], weights[k]) for k in weights)  # weights untouched
    assert torch.equal(opt.state_dict()["state"][0]["step"], state)
    assert torch.equal(torch.rand(2), draw)  # RNG untouched


@pytest.mark.parametrize("name", ["optim_opt.json", "rng.json", "meta.json"])
def test_a_pickle_planted_in_a_checkpoint_file_is_never_unpickled(cut, tmp_path, name):
    marker = tmp_path / "pwned"
    ckpt = _ckpt(cut)
    (ckpt / name).write_bytes(pickle.dumps(_CreatesAFile(marker)))
    if name != "meta.json":
        _reseal(ckpt, name)  # the manifest agrees: only the loader stands between the pickle and the user
    before = (cut / "metrics.jsonl").read_bytes()
    result = cli.invoke(app, ["run", "smoke-digits", "--out", str(cut), "--resume", *FAST])
    assert not marker.exists()
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert f"step_00000010/{name}" in result.output or "step_00000010 " in result.output, result.output
    assert (cut / "metrics.jsonl").read_bytes() == before  # stopped before anything was cut or rerun


def _make_legacy(ckpt, payload=None):
    """Rewrite a checkpoint in the old layout: optim_opt.pt, rng.pt (torch.save pickles), CRC32 manifest."""
    import zlib

    from reprlab.runs.checkpoint import read_state

    opt_state, rng = read_state(ckpt, "optim_opt"), read_state(ckpt, "rng")
    rs = np.random.RandomState()
    rs.set_state(rng["numpy"])
    rng["numpy"] = rs.get_state()  # the old code saved numpy's legacy tuple
    for stem in ("optim_opt", "rng"):
        (ckpt / f"{stem}.json").unlink()
        (ckpt / f"{stem}.safetensors").unlink()
    torch.save(payload if payload is not None else opt_state, ckpt / "optim_opt.pt")
    torch.save(payload if payload is not None else rng, ckpt / "rng.pt")
    meta = json.loads((ckpt / "meta.json").read_text())
    meta.pop("format")
    meta["files"] = {f.name: {"size": f.stat().st_size, "crc32": zlib.crc32(f.read_bytes())}
                     for f in sorted(ckpt.iterdir()) if f.name != "meta.json"}  # fmt: skip
    (ckpt / "meta.json").write_text(json.dumps(meta))


def test_old_pickled_checkpoints_are_refused_with_the_conversion_and_the_conversion_resumes_exactly(
    runs, cut
):
    full, _ = runs
    for ckpt in (cut / "checkpoints" / "train").iterdir():
        _make_legacy(ckpt)
    result = cli.invoke(app, ["run", "smoke-digits", "--out", str(cut), "--resume", *FAST])
    assert result.exit_code == 2, result.output
    assert "old checkpoint format" in result.output and f"reprlab convert-checkpoint {cut}" in result.output
    converted = cli.invoke(app, ["convert-checkpoint", str(cut)])
    assert converted.exit_code == 0 and "converted 1 checkpoint" in converted.output, converted.output
    assert not list(cut.rglob("*.pt"))
    execute("smoke-digits", FAST, cut, resume=True, quiet=True)
    assert _summary(cut) == _summary(full)  # same path from the same states: exactly
    assert (cut / "metrics.jsonl").read_bytes() == (full / "metrics.jsonl").read_bytes()


@pytest.mark.parametrize("raw", [False, True], ids=["torch.save", "pickle"])
def test_a_malicious_old_checkpoint_is_refused_by_resume_and_by_the_conversion(cut, tmp_path, raw):
    marker = tmp_path / "pwned"
    ckpt = _ckpt(cut)
    _make_legacy(ckpt, payload=_CreatesAFile(marker))
    if raw:  # a plain pickle stream rather than torch's zip container
        for name in ("optim_opt.pt", "rng.pt"):
            (ckpt / name).write_bytes(pickle.dumps(_CreatesAFile(marker)))
        _make_legacy_manifest(ckpt)
    resumed = cli.invoke(app, ["run", "smoke-digits", "--out", str(cut), "--resume", *FAST])
    converted = cli.invoke(app, ["convert-checkpoint", str(cut)])
    assert not marker.exists()
    assert resumed.exit_code == 2 and "old checkpoint format" in resumed.output, resumed.output
    assert converted.exit_code == 2 and "restricted loader refused it" in converted.output, converted.output
    assert (
        "--trust" in converted.output and (ckpt / "rng.pt").exists()
    )  # the old checkpoint is left as it was


def _make_legacy_manifest(ckpt):
    import zlib

    meta = json.loads((ckpt / "meta.json").read_text())
    meta["files"] = {f.name: {"size": f.stat().st_size, "crc32": zlib.crc32(f.read_bytes())}
                     for f in sorted(ckpt.iterdir()) if f.name != "meta.json"}  # fmt: skip
    (ckpt / "meta.json").write_text(json.dumps(meta))


def test_resume_from_names_a_missing_checkpoint_with_the_ones_there_are(cut):
    result = cli.invoke(app, ["run", "smoke-digits", "--out", str(cut), "--resume-from", "step_7", *FAST])
    assert result.exit_code == 2 and "has no such checkpoint (it has: train/step_00000010)" in result.output


def test_keep_every_spares_every_nth_step_beside_the_last_ones(tmp_path):
    """keep_last=2, keep_every=2 over steps 1-7: the last two (6, 7) and every second before them (2, 4) stay."""
    for step in range(1, 8):
        save_checkpoint_dir(tmp_path, step, {}, None, keep_last=2, keep_every=2)
    assert [step_of(f) for f in list_checkpoints(tmp_path)] == [2, 4, 6, 7]
    for step in range(8, 10):  # without it, only the last two
        save_checkpoint_dir(tmp_path, step, {}, None, keep_last=2)
    assert [step_of(f) for f in list_checkpoints(tmp_path)] == [8, 9]
