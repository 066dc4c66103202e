"""User data end to end on real files: Fashion-MNIST written as PNGs (train + captions.csv, ImageFolders),
poisoned by `reprlab otcclip poison`, two defenses streamed from the poisoned shards, evaluated on the test
ImageFolder; the zero-shot and ASR keys are recomputed by a plain independent path (PIL + the model's encoders)
over exactly the manifest's targets and trigger, and `reprlab otcclip evaluate` reproduces them."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from typer.testing import CliRunner

from reprlab.cli import app
from reprlab.config import load_config
from reprlab.errors import DataError
from reprlab.methods.otcclip import recipe
from reprlab.methods.otcclip.config import EvalConfig
from reprlab.methods.otcclip.data.fashion_files import write_fashion_files
from reprlab.methods.otcclip.data.triggers import apply_trigger
from reprlab.methods.otcclip.evaluation.folder import FolderEval
from reprlab.methods.otcclip.models.run_model import load_run_model
from reprlab.runs import Run

YAML = Path(recipe.__file__).parent / "recipes" / "otcclip-folder-tiny.yaml"
# a few steps of a small model: the keys and their agreement with the planted poisons are tested, not accuracy
MICRO = ["threads=1", "train.epochs=1", "train.batch_size=20", "model.width=32", "model.text_width=32",
         "model.layers=1", "model.text_layers=1", "stream.num_workers=0", "stream.window_batches=4",
         "stream.shuffle_buffer=0", "defense.safeclip_unimodal_epochs=0", "defense.bank_size=64"]  # fmt: skip


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory):
    root = tmp_path_factory.mktemp("user")
    files = write_fashion_files(root / "files", n_train=160, n_probe_train=40, n_test=60, n_target_pool=20)
    out = root / "poisoned"
    res = CliRunner().invoke(app, ["otcclip", "poison", files["captions"], str(out), "--targets-from",
                                   files["targets"], "--n-targets", "2", "-n", "6", "--backdoor", "12",
                                   "--backdoor-target", "bag", "--image-size", "56", "--trigger-patch", "8",
                                   "--trigger", "badnets", "--trigger", "blended", "--n-shards", "2"])  # fmt: skip
    assert res.exit_code == 0, res.output
    return files, out


def _pil(path: Path) -> torch.Tensor:
    """The independent decode: PIL, RGB, bicubic to 56 px (the images are square), uint8 (3, 56, 56)."""
    from PIL import Image

    with Image.open(path) as im:
        arr = np.array(im.convert("RGB").resize((56, 56), Image.Resampling.BICUBIC))
    return torch.from_numpy(arr).permute(2, 0, 1).contiguous()


@torch.no_grad()
def _classify(model, tok, images: torch.Tensor, classes, templates, max_len) -> torch.Tensor:
    ids, mask = tok.encode([t.format(c) for c in classes for t in templates], max_len)
    text = F.normalize(model.encode_text(ids, mask).global_, dim=-1).view(len(classes), len(templates), -1)
    cls = F.normalize(text.mean(1), dim=-1)
    img = F.normalize(model.encode_image(images.float() / 127.5 - 1).global_, dim=-1)
    return (img @ cls.T).argmax(1)


def test_user_data_poisoned_trained_evaluated_end_to_end(poisoned, tmp_path):
    files, out = poisoned
    cfg = load_config(recipe.Config, yaml.safe_load(YAML.read_text())["config"], [
        *MICRO, "data.testbed=none", "poison.enabled=false", f"stream.source={out}", "defenses=[none,safeclip]",
        f"eval.zeroshot_dir={files['test']}", f"eval.probe_train_dir={files['probe_train']}",
        f"eval.templates={files['templates']}", "eval.every_epoch=false"])  # fmt: skip
    recipe.preflight(cfg)
    run = Run.create(tmp_path / "run", cfg, "otcclip-folder-tiny", quiet=True)
    summary = recipe.run(cfg, run)
    manifest = json.loads((out / "manifest.json").read_text())
    p = manifest["poison"]
    data = json.loads((run.dir / "analysis" / "data.json").read_text())
    assert data["poison_manifest"] == str(out / "manifest.json")  # found beside the trained shards
    assert summary["poison_rate"] == pytest.approx(len(p["planted"]) / manifest["n_samples"], abs=0)
    assert summary["n_pairs"] == manifest["n_samples"]
    # two backdoors (one per --trigger), 12 pairs each, made from disjoint clean pairs
    assert [b["trigger"]["kind"] for b in p["backdoors"]] == ["badnets", "blended"]
    assert len({s for b in p["backdoors"] for s in b["source_keys"]}) == 24
    assert {r["trigger"] for r in p["planted"] if r["kind"] == "backdoor"} == {"badnets", "blended"}
    classes = tuple(c.replace("_", " ") for c in sorted(x.name for x in Path(files["test"]).iterdir()))
    templates = Path(files["templates"]).read_text().split("\n")[:-1]
    test = [
        (f, c) for c, d in enumerate(sorted(Path(files["test"]).iterdir())) for f in sorted(d.glob("*.png"))
    ]
    bag = classes.index("bag")
    for d in ("none", "safeclip"):
        for k in ("zeroshot_acc", "linear_probe_acc", "asr_targeted", "asr_backdoor"):
            assert 0 <= summary[f"{d}.{k}"] <= 1
        model, tok, _ = load_run_model(run.dir, d)
        # targeted: the manifest's target copies, each counted against its own adversarial class
        want = torch.tensor([classes.index(t["target_class"]) for t in p["targeted"]])
        imgs = torch.stack([_pil(out / t["image"]) for t in p["targeted"]])
        asr_t = (_classify(model, tok, imgs, classes, templates, 32) == want).float().mean().item()
        assert summary[f"{d}.asr_targeted"] == pytest.approx(asr_t, abs=1e-9)  # a share of 2 targets: exact
        # zero-shot over the folder
        imgs = torch.stack([_pil(f) for f, _ in test])
        labels = torch.tensor([c for _, c in test])
        pred = _classify(model, tok, imgs, classes, templates, 32)
        # a different code path (our PIL loading and batching): one near-tied item may round the other way on
        # another CPU's kernels, so one item of slack; a broken evaluation is off by far more
        one = 1 / len(labels) + 1e-9
        assert summary[f"{d}.zeroshot_acc"] == pytest.approx((pred == labels).float().mean().item(), abs=one)
        # each backdoor: images not of the target class, its planted trigger applied at 56 px; the key is the mean
        asrs = []
        for bd in p["backdoors"]:
            trig, keep = bd["trigger"], labels != bag
            x = apply_trigger(
                imgs[keep], trig["kind"], trig["seed"], trig["patch"], trig["alpha"], **trig["params"]
            )
            asrs.append((_classify(model, tok, x, classes, templates, 32) == bag).float().mean().item())
            n_bd = int(keep.sum())
            assert summary[f"{d}.asr_backdoor_{trig['kind']}"] == pytest.approx(
                asrs[-1], abs=1 / n_bd + 1e-9
            )  # ~54 images; one near-tied item of slack, as above
        assert summary[f"{d}.asr_backdoor"] == pytest.approx(sum(asrs) / 2, abs=1 / n_bd + 1e-9)
    # `reprlab otcclip evaluate` on the finished run: the same keys, the same values (the same code path)
    res = CliRunner().invoke(app, ["otcclip", "evaluate", str(run.dir)])
    assert res.exit_code == 0, res.output
    again = json.loads((run.dir / "eval" / "folder_eval.json").read_text())["summary"]
    for k, v in again.items():
        assert summary[k] == pytest.approx(v, abs=1e-6), k  # a reloaded checkpoint: float32 round trip


def test_manifest_classes_must_be_eval_classes(poisoned, tmp_path):
    files, out = poisoned
    names = tmp_path / "names.json"
    folders = sorted(x.name for x in Path(files["test"]).iterdir())
    names.write_text(json.dumps({f: ("handbag" if f == "bag" else f.replace("_", " ")) for f in folders}))
    with pytest.raises(DataError, match="'bag' is not a class"):
        FolderEval(EvalConfig(zeroshot_dir=files["test"], class_names=str(names), poison_manifest=str(out)))
    with pytest.raises(DataError, match="names.json"):
        names.write_text("[1, 2]")
        FolderEval(EvalConfig(zeroshot_dir=files["test"], class_names=str(names)))


def test_otcclip_folder_tiny_recipe_micro(tmp_path):
    """The recipe's own path: stages files -> poison -> streamed training -> folder evaluation."""
    cfg = load_config(recipe.Config, yaml.safe_load(YAML.read_text())["config"], [
        *MICRO, "data.n_pairs=120", "data.n_probe_train=30", "data.n_eval=40", "poison.captions_per_target=4",
        "poison.backdoor=10", "poison.n_targets=2", "defenses=[none]", "eval.every_epoch=false"])  # fmt: skip
    recipe.preflight(cfg)
    run = Run.create(tmp_path / "run", cfg, "otcclip-folder-tiny", quiet=True)
    summary = recipe.run(cfg, run)
    for k in ("zeroshot_acc", "linear_probe_acc", "asr_targeted", "asr_backdoor"):
        assert f"none.{k}" in summary
    m = json.loads((run.dir / "poisoned" / "manifest.json").read_text())
    assert summary["n_pairs"] == m["n_samples"] == 120 + 2 * 4
    assert {"files", "poison", "none"} <= {p.stem for p in (run.dir / "stages").glob("*.json")}


def test_preflight_names_what_does_not_fit(tmp_path):
    from reprlab.errors import ConfigError, DataFileMissingError

    base = yaml.safe_load(YAML.read_text())["config"]
    cases = [
        (["data.testbed=fashion_mnist", "poison.enabled=false", f"eval.zeroshot_dir={tmp_path}"], ConfigError, "data.testbed=none"),
        (["data.testbed=none", "poison.enabled=true"], ConfigError, "stream.source"),
        ([f"stream.source={tmp_path}"], ConfigError, "data.testbed 'files'"),
        (["data.testbed=none", f"stream.source={tmp_path}", "poison.enabled=false",
          f"eval.zeroshot_dir={tmp_path / 'nowhere'}"], DataFileMissingError, "nowhere"),
    ]  # fmt: skip
    (tmp_path / "x.tar").write_bytes(b"")
    for overrides, err, text in cases:
        cfg = load_config(recipe.Config, base, overrides)
        with pytest.raises(err) as info:
            recipe.preflight(cfg)
        assert text in str(info.value) + str(getattr(info.value, "hint", "")), (overrides, str(info.value))


def test_report_of_data_with_one_attack_names_the_attack_it_measured(tmp_path):
    """Data poisoned with targeted poisons and no trigger has no backdoor ASR: the report's gate note names the
    targeted one only (it raised KeyError on the missing key) and the table shows the gap as NaN."""
    from reprlab.methods.otcclip.pipeline.report import report_sections

    (tmp_path / "analysis").mkdir()
    results = {"none": {"zeroshot_acc": 0.5, "linear_probe_acc": 0.6, "asr_targeted": 0.8}}
    (tmp_path / "analysis" / "results.json").write_text(json.dumps(results))
    (tmp_path / "analysis" / "data.json").write_text(json.dumps({"testbed": "none"}))
    first = report_sections(tmp_path)[0]
    gate = [line for line in first.text.splitlines() if line.startswith("Gate")]
    assert gate == ["Gate: undefended CLIP ASR targeted 0.80 (attacked); zero-shot 0.50."]
    assert first.table[0]["asr_backdoor"] != first.table[0]["asr_backdoor"]  # NaN
