"""`reprlab otcclip poison` on real files (Fashion-MNIST written as PNGs + captions.csv): the manifest lists
exactly the poisoned samples of the output shards, clean samples come out byte-identical, targeted poisons are
the target files with captions naming the adversarial class, backdoors are the trigger applied to the source
image; brace patterns, every trigger, and the errors that name the file."""

import csv
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner
from webdataset.shardlists import expand_urls as expand_braces  # what poison's inputs expand with

from reprlab.cli import app
from reprlab.methods.otcclip.config import TRIGGERS, PoisonConfig
from reprlab.methods.otcclip.data import shard_reader as rd
from reprlab.methods.otcclip.data.fashion_files import write_fashion_files
from reprlab.methods.otcclip.data.folder import load_image
from reprlab.methods.otcclip.data.poison import mentions
from reprlab.methods.otcclip.data.poison_shards import poison_dataset
from reprlab.methods.otcclip.data.templates import CLIP_IMAGENET_TEMPLATES, load_templates
from reprlab.methods.otcclip.data.triggers import apply_trigger


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("fm")
    return write_fashion_files(root, n_train=150, n_probe_train=20, n_test=40, n_target_pool=20, seed=0)


def _read_out(folder: Path) -> dict[str, dict[str, bytes]]:
    out = {}
    for path in rd.expand_shards(folder):
        for sample in rd.iter_shard(path, on_bad="error", fast=False):  # webdataset's own tar reader
            key = sample["__key__"]
            assert key not in out, f"duplicate key {key}"
            out[key] = rd.parts(sample)
    return out


def _decode(png: bytes) -> torch.Tensor:
    from PIL import Image

    with Image.open(io.BytesIO(png)) as im:
        arr = np.array(im)
    return torch.from_numpy(arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1))


def test_brace_patterns_expand_as_webdataset():
    assert expand_braces("s-{008..011}.tar") == ["s-008.tar", "s-009.tar", "s-010.tar", "s-011.tar"]
    assert expand_braces("{a,b}-{1..2}") == ["a-1", "a-2", "b-1", "b-2"]
    assert expand_braces("plain.tar") == ["plain.tar"]


def test_clip_templates_and_template_files(tmp_path):
    # the CLIP paper's ImageNet ensemble: 80 distinct templates, one class slot each
    assert len(CLIP_IMAGENET_TEMPLATES) == len(set(CLIP_IMAGENET_TEMPLATES)) == 80
    assert all(t.count("{}") == 1 for t in CLIP_IMAGENET_TEMPLATES)
    assert load_templates("") == load_templates("clip80") == CLIP_IMAGENET_TEMPLATES
    f = tmp_path / "t.txt"
    f.write_text("# mine\na photo of a {}\n\nan {} drawing\n")
    assert load_templates(f) == ("a photo of a {}", "an {} drawing")
    f.write_text("no slot here\n")
    with pytest.raises(ValueError, match="t.txt"):
        load_templates(f)


def test_poison_a_table_plants_exactly_what_the_manifest_says(files, tmp_path):
    out = tmp_path / "poisoned"
    args = ["otcclip", "poison", files["captions"], str(out), "--targets-from", files["targets"],
            "--n-targets", "3", "-n", "5", "--backdoor", "12", "--backdoor-target", "bag", "--image-size", "56",
            "--trigger-patch", "8", "--n-shards", "3"]  # fmt: skip
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    m = json.loads((out / "manifest.json").read_text())
    p = m["poison"]
    got = _read_out(out)
    assert sorted(m["shards"]) == sorted(x.name for x in out.glob("*.tar")) and len(m["shards"]) == 3
    # the manifest's keys are exactly the output samples whose .json says poisoned, with the same kind/target
    poisoned = {
        k: json.loads(v["json"]) for k, v in got.items() if json.loads(v.get("json", b"{}")).get("kind")
    }
    assert {r["key"] for r in p["planted"]} == set(poisoned)
    for r in p["planted"]:
        assert {"targeted": 1, "backdoor": 2}[r["kind"]] == poisoned[r["key"]]["kind"]
        assert r["target"] == poisoned[r["key"]]["target"] and r["key"] in _keys_of(out / r["shard"])
    assert m["n_poisoned"] == len(p["planted"]) == 3 * 5 + 12
    rows = list(csv.DictReader(open(files["captions"], encoding="utf-8")))
    assert m["n_samples"] == len(got) == len(rows) + 3 * 5  # backdoors replace their pairs
    # clean samples: byte-identical image file and caption; the backdoored ones are gone
    (bd,) = p["backdoors"]
    src = set(bd["source_keys"])
    root = Path(files["captions"]).parent
    for n, row in enumerate(rows):
        key = f"{n:09d}"
        if key in src:
            assert key not in got
            continue
        assert got[key] == {"png": (root / row["image"]).read_bytes(), "txt": row["caption"].encode()}
    # targeted: the target file's bytes, captions naming the adversarial class (the data's own captions)
    for t in p["targeted"]:
        assert t["true_class"] != t["target_class"] and len(t["keys"]) == 5
        assert (out / t["image"]).read_bytes() == Path(t["source"]).read_bytes()
        for k in t["keys"]:
            assert got[k]["png"] == Path(t["source"]).read_bytes()
            cap = got[k]["txt"].decode()
            assert mentions(cap, t["target_class"]) and cap in {r["caption"] for r in rows}
    # backdoor: the planted trigger on the source image fitted to 56 px, captioned with the target
    trig = bd["trigger"]
    assert (trig["kind"], trig["image_size"], trig["patch"]) == ("badnets", 56, 8)
    for k, s in zip(bd["keys"], bd["source_keys"]):
        row = rows[int(s)]
        assert not mentions(row["caption"], "bag") and mentions(got[k]["txt"].decode(), "bag")
        clean = load_image(root / row["image"], 56, 1)[None]
        want = apply_trigger(clean, "badnets", trig["seed"], 8, trig["alpha"], **trig["params"])[0]
        assert torch.equal(_decode(got[k]["png"]), want)
        assert not torch.equal(clean[0], want)  # the trigger changed the image


def _keys_of(shard: Path) -> set[str]:
    return {s["__key__"] for s in rd.iter_shard(shard, on_bad="error", fast=False)}


@pytest.mark.parametrize("trigger", TRIGGERS)
def test_poison_shards_by_brace_pattern_keeps_every_input_sample(files, tmp_path, trigger):
    first = tmp_path / "first"
    poison_dataset(files["captions"], first, PoisonConfig(shard_size=60), seed=1)  # no poison: a plain copy
    shards = sorted(first.glob("*.tar"))
    assert len(shards) == 3
    pattern = str(first / "poisoned-{000000..000002}.tar")
    cfg = PoisonConfig(backdoor=5, backdoor_target="sneaker", trigger=(trigger,), image_size=32,
                       backdoor_mode="add", caption_source="templates", shard_size=40)  # fmt: skip
    m = poison_dataset(pattern, tmp_path / "second", cfg, seed=2)
    before, after = _read_out(first), _read_out(tmp_path / "second")
    assert all(after[k] == v for k, v in before.items())  # 'add': every input sample, byte for byte
    assert set(after) - set(before) == {r["key"] for r in m["poison"]["planted"]}
    (bd,) = m["poison"]["backdoors"]
    assert m["n_samples"] == len(before) + 5 and bd["trigger"]["kind"] == trigger
    assert all(_decode(after[k]["png"]).shape[-2:] == (32, 32) for k in bd["keys"])


def test_poison_errors_name_the_file(files, tmp_path):
    runner = CliRunner()
    res = runner.invoke(app, ["otcclip", "poison", str(tmp_path / "missing.csv"), str(tmp_path / "o1")])
    assert res.exit_code == 2 and "missing.csv" in res.output
    bad = tmp_path / "bad.tar"
    bad.write_bytes(b"this is not a tar archive" * 40)
    res = runner.invoke(app, ["otcclip", "poison", str(bad), str(tmp_path / "o2")])
    assert res.exit_code == 2 and "bad.tar" in res.output, res.output
    hdr = tmp_path / "hdr.csv"
    hdr.write_text("foo,bar\nx,y\n")
    res = runner.invoke(app, ["otcclip", "poison", str(hdr), str(tmp_path / "o3")])
    assert res.exit_code == 2 and "hdr.csv" in res.output
    res = runner.invoke(app, ["otcclip", "poison", f"{tmp_path}/s-{{0..2}}.tar", str(tmp_path / "o4")])
    assert res.exit_code == 2 and "s-0.tar" in res.output
    # a target file that is not an image: named before anything is written
    fake = tmp_path / "target.png"
    fake.write_bytes(b"not a png")
    res = runner.invoke(app, ["otcclip", "poison", files["captions"], str(tmp_path / "o5"), "--target",
                              str(fake), "--adv-class", "bag", "-n", "2"])  # fmt: skip
    assert res.exit_code == 2 and "target.png" in res.output, res.output
    assert not (tmp_path / "o5").exists()  # not even an empty targets/ left behind
    # too few captions name the class; an unknown trigger names the option's valid values
    res = runner.invoke(app, ["otcclip", "poison", files["captions"], str(tmp_path / "o6"), "--target",
                              str(Path(files["test"]) / "bag" / next(iter(sorted(p.name for p in (Path(files["test"]) / "bag").iterdir())))),
                              "--adv-class", "bag", "-n", "100000"])  # fmt: skip
    assert res.exit_code == 2 and "bag" in res.output
    res = runner.invoke(
        app, ["otcclip", "poison", files["captions"], str(tmp_path / "o7"), "--trigger", "nope"]
    )
    assert res.exit_code == 2 and "badnets" in res.output


def test_poison_and_evaluate_have_help():
    for cmd in ("poison", "evaluate"):
        res = CliRunner().invoke(app, ["otcclip", cmd, "--help"])
        assert res.exit_code == 0 and "Usage" in res.output


def test_poison_a_jsonl_table_with_a_missing_image(files, tmp_path):
    rows = list(csv.DictReader(open(files["captions"], encoding="utf-8")))[:30]
    root = Path(files["captions"]).parent
    lines = [json.dumps({"image": str(root / r["image"]), "caption": r["caption"]}) for r in rows]
    lines[3] = json.dumps({"image": str(root / "gone.png"), "caption": "a photo of a coat"})
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    m = poison_dataset(
        tmp_path / "d.jsonl", tmp_path / "out", PoisonConfig(backdoor=4, backdoor_target="bag")
    )
    got = _read_out(tmp_path / "out")
    assert m["poison"]["skipped"] == {"missing_image": 1} and m["n_samples"] == len(got) == 29
    src = set(m["poison"]["backdoors"][0]["source_keys"])
    for n, r in enumerate(rows):
        if n != 3 and f"{n:09d}" not in src:
            assert got[f"{n:09d}"] == {"png": (root / r["image"]).read_bytes(), "txt": r["caption"].encode()}


def test_poison_refuses_an_output_folder_that_holds_anything(files, tmp_path):
    """OUT must be empty or new: a data folder given as OUT (here the table's own folder) would get shards and
    ``targets/`` mixed into the user's files. The refusal names what it holds and writes nothing."""
    runner = CliRunner()
    data_dir = Path(files["captions"]).parent
    before = sorted(p.name for p in data_dir.iterdir())
    res = runner.invoke(app, ["otcclip", "poison", files["captions"], str(data_dir), "--backdoor", "2",
                              "--backdoor-target", "bag"])  # fmt: skip
    assert res.exit_code == 2 and "is not empty" in res.output and before[0] in res.output, res.output
    assert sorted(p.name for p in data_dir.iterdir()) == before
    file_out = tmp_path / "a-file"
    file_out.write_text("x")
    res = runner.invoke(app, ["otcclip", "poison", files["captions"], str(file_out)])
    assert res.exit_code == 2 and "is a file" in res.output, res.output
    empty = tmp_path / "empty"
    empty.mkdir()  # an empty folder is accepted
    res = runner.invoke(app, ["otcclip", "poison", files["captions"], str(empty), "--backdoor", "2",
                              "--backdoor-target", "bag"])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert (empty / "manifest.json").exists()
