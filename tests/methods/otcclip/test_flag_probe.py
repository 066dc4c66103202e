"""``train.keep_every`` and the flag probe (``reprlab otcclip flag-probe``): every epoch's checkpoint kept, and the
probe's release count equal to the one the trainer logged from the same checkpoint (an independent path: the probe
rebuilds the model, data and flag state from the run folder alone)."""

import json
from pathlib import Path

import pytest
import torch
import yaml

from reprlab.config import load_config
from reprlab.errors import ConfigError, RunFolderError
from reprlab.methods.otcclip import recipe
from reprlab.methods.otcclip.defenses.blend import blend_cosine
from reprlab.methods.otcclip.evaluation.flag_probe import TESTS, occlusion_drop
from reprlab.methods.otcclip.pipeline.flag_probe import probe_run
from reprlab.runs import Run

from .test_recipe import MINI

YAML = Path(recipe.__file__).parent / "recipes" / "otcclip-tiny.yaml"
# the flag on epochs 0-1, the release from epoch 2 on: epochs 2 and 3 release without flagging
FLAG = [
    "data.n_pairs=240",
    "data.backdoor_pairs=24",
    "data.clean_finetune_pairs=0",
    "defenses=[otcclip]",
    "audit_defense=",
    "train.epochs=4",
    "defense.flag_start=0",
    "defense.flag_until=1",
    "defense.flag_release_epoch=2",
    # the blend veto on the release, so the probe must draw the backgrounds the trainer drew
    "defense.flag_release_veto=0.3",
    # a held cohort from epoch 1 (its top share, no purity or persistence), so the release must leave it out
    "defense.flag_cohort_start=1",
    "defense.flag_cohort_epochs=3",
    "defense.flag_cohort_share=0.05",
    "defense.flag_cohort_purity=0",
    "defense.flag_cohort_persist=1",
    "defense.flag_cohort_grow=0",
    "defense.flagged_unlearn=0",
]


@pytest.fixture(scope="module")
def flag_run(tmp_path_factory):
    spec = yaml.safe_load(YAML.read_text())
    mini = [o for o in MINI if not o.startswith(("data.n_pairs", "data.backdoor_pairs", "train.epochs"))]
    cfg = load_config(recipe.Config, spec["config"], [*mini, *FLAG, "train.keep_every=1"])
    run = Run.create(tmp_path_factory.mktemp("probe") / "r", cfg, "otcclip-tiny", quiet=True)
    recipe.run(cfg, run)
    return run.dir


def test_keep_every_keeps_each_epochs_checkpoint(flag_run):
    kept = sorted(p.name for p in (flag_run / "checkpoints" / "otcclip").iterdir())
    assert kept == [f"step_{e:08d}" for e in (1, 2, 3, 4)]  # the default keeps the last two only


def test_probe_release_counts_equal_the_trainers(flag_run):
    logged, vetoed = {}, {}
    for line in (flag_run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("defense") == "otcclip" and "released" in row:
            logged[row["epoch"]], vetoed[row["epoch"]] = row["released"], row["release_vetoed"]
    assert set(logged) == {2, 3} and logged[2] > 0, logged
    assert vetoed[2] > 0, vetoed  # the veto acted, so equal counts need the same backgrounds
    from safetensors.torch import load_file

    held = load_file(str(flag_run / "checkpoints" / "otcclip" / "step_00000002" / "state.safetensors"))[
        "held"
    ]
    assert held.any()  # the release's "not held" part is exercised
    probes = probe_run(flag_run, [2, 3])
    for p in probes:
        assert p.released == logged[p.epoch], (p, logged)
        assert set(p.auroc) == set(TESTS)
        assert all(0.0 <= v <= 1.0 for v in p.auroc.values() if v == v)
        assert p.flagged_clean + p.flagged_backdoor > 0
        for share in (p.rematch_clean_own_concept, p.rematch_backdoor_to_target, p.target_clean_flagged):
            assert share != share or 0.0 <= share <= 1.0  # NaN where no row qualifies


def test_probe_names_a_missing_checkpoint(flag_run, tmp_path):
    import shutil

    pruned = tmp_path / "pruned"
    shutil.copytree(flag_run, pruned)
    shutil.rmtree(pruned / "checkpoints" / "otcclip" / "step_00000001")  # as without train.keep_every
    with pytest.raises(FileNotFoundError, match=r"step_00000001") as err:
        probe_run(pruned, [1])
    assert "train.keep_every=1" in err.value.hint
    with pytest.raises(RunFolderError, match="no config.yaml"):
        probe_run(tmp_path, [2])
    with pytest.raises(ConfigError, match=r"between 1 and train.epochs \(4\)"):
        probe_run(flag_run, [0])
    with pytest.raises(ConfigError, match="was not trained"):
        probe_run(flag_run, [2], defense="safeclip")


def test_probe_refuses_a_streamed_run(flag_run, tmp_path):
    import shutil

    streamed = tmp_path / "s"
    shutil.copytree(flag_run, streamed)
    cfg = yaml.safe_load((streamed / "config.yaml").read_text())
    cfg["stream"]["write_shards"] = True  # its pairs were shards, not the testbed the probe would rebuild
    (streamed / "config.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(RunFolderError, match="in-memory testbed runs only"):
        probe_run(streamed, [2])


class _Mean(torch.nn.Module):
    """A stand-in image tower: the feature is (mean pixel, 1) normalised, so the answers are known."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def encode_image(self, x):
        m = x.mean(dim=(1, 2, 3))
        f = torch.stack([m, torch.ones_like(m)], 1)

        class F:
            global_ = f / f.norm(dim=1, keepdim=True)

        return F


def test_blend_and_occlusion_on_a_known_tower(monkeypatch):
    from reprlab.methods.otcclip.defenses import blend
    from reprlab.methods.otcclip.evaluation import flag_probe

    for module in (blend, flag_probe):
        monkeypatch.setattr(module, "embed_images", lambda model, x: model.encode_image(x.float()).global_)
    model = _Mean()
    img = torch.zeros(2, 1, 32, 32, dtype=torch.uint8)
    img[1, :, :16, :16] = 255  # one bright quarter
    txt = torch.tensor([[1.0, 0.0], [1.0, 0.0]])  # cosine with (m, 1)/|.| is m / sqrt(m^2 + 1)
    bg = torch.zeros(1, 1, 32, 32, dtype=torch.uint8)

    def cos(m):
        m = torch.tensor(m)
        return m / torch.sqrt(m**2 + 1)

    # blended half into a black image: the quarter holds round(127.5) = 128, the mean 32
    assert torch.allclose(blend_cosine(model, img, txt, bg), cos([0.0, 32.0]), atol=1e-6)
    # blanking the bright quarter takes image 1's cosine to 0; image 0 has nothing to lose
    drop = occlusion_drop(model, img, txt, block=16, stride=16)
    assert torch.allclose(drop, cos([0.0, 255 / 4]), atol=1e-6)
    none = torch.zeros(0, 1, 32, 32, dtype=torch.uint8)  # an epoch with nothing flagged: no rows, no error
    assert blend_cosine(model, none, txt[:0], bg).shape == occlusion_drop(model, none, txt[:0]).shape == (0,)


def test_flag_probe_command_prints_one_row_per_epoch(flag_run):
    from typer.testing import CliRunner

    from reprlab.cli import app

    out = CliRunner().invoke(app, ["otcclip", "flag-probe", str(flag_run), "--epochs", "2,3"])
    assert out.exit_code == 0, out.output
    rows = [line for line in out.output.splitlines() if line.startswith("| 2 ") or line.startswith("| 3 ")]
    assert len(rows) == 2 and "support" in out.output
    bad = CliRunner().invoke(app, ["otcclip", "flag-probe", str(flag_run), "--epochs", "two"])
    assert bad.exit_code != 0 and "comma-separated integers" in bad.output
