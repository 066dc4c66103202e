"""The audit rebuilds the model a run trained (``model.arch`` of its resolved config, through ``build_model``) and
its tokenizer: a run with ``model.arch=hf_clip`` is audited with its HF CLIP, not a TinyCLIP; an arch that cannot
be built here stays the clean ModelNotAvailableError."""

import pytest
import torch

from reprlab.errors import ModelNotAvailableError
from reprlab.methods.otcclip.data.tokenizer import WordTokenizer
from reprlab.methods.otcclip.evaluation.audit import audit_pairs
from reprlab.methods.otcclip.models.build import build_model
from reprlab.methods.otcclip.models.hf import HFCLIPAdapter, HFTokenizerAdapter
from reprlab.methods.otcclip.models.run_model import load_run_model
from reprlab.methods.otcclip.pipeline import run as recipe
from reprlab.runs import Run
from tests.methods.otcclip.test_recipe import _audit_cli_on_user_files, _cfg
from tests.methods.otcclip.test_special_tokens import _hf_clip_tokenizer


def _hf_run(tmp_path, tokenizer: str):
    """A run folder as an ``hf_clip`` run leaves it (config.yaml, tokenizer, a checkpoint of defense ``none``),
    with random weights: the word tokenizer (in-memory path) or a HF CLIP tokenizer folder (streamed path, which
    saves no tokenizer.json)."""
    extra = ["model.arch=hf_clip", "model.image_size=28", "model.patch_size=7", "audit_defense=none"]
    if tokenizer == "hf":
        hf = _hf_clip_tokenizer(tmp_path)
        extra.append(f"model.tokenizer={tmp_path / 'tok'}")
    cfg = _cfg(extra)
    run = Run.create(tmp_path / "r", cfg, "otcclip-mosaic-tiny", quiet=True)
    bed = recipe.build_testbed(cfg.data, cfg.seed)
    if tokenizer == "hf":
        tok = hf
    else:
        tok = WordTokenizer.from_texts(bed.pairs.captions)
        (run.dir / "artifacts").mkdir(parents=True, exist_ok=True)
        tok.save(run.dir / "artifacts" / "tokenizer.json")
    torch.manual_seed(3)
    model = build_model(cfg.model, len(tok), bed.pairs.images.shape[1])
    run.save_checkpoint(0, {"model": model}, tag="none")
    return cfg, run, bed, tok, model


@pytest.mark.parametrize("tokenizer", ["word", "hf"])
def test_audit_of_an_hf_clip_run_uses_its_hf_clip(tmp_path, tokenizer):
    cfg, run, bed, tok, trained = _hf_run(tmp_path, tokenizer)
    model, got_tok, got_cfg = load_run_model(run.dir, "none")
    assert isinstance(model, HFCLIPAdapter) and got_cfg.model.arch == "hf_clip"
    assert isinstance(got_tok, HFTokenizerAdapter if tokenizer == "hf" else WordTokenizer)
    assert model.text_pool == ("eos" if tokenizer == "hf" else "mean")
    want = trained.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())  # the checkpoint's weights
    a = audit_pairs(model, got_tok, bed.pairs, top_k=4)
    b = audit_pairs(trained, tok, bed.pairs, top_k=4)
    assert (a.score == b.score).all()
    # the testbed audit of the recipe (audit_defense) rebuilds the same model
    res = recipe.audit_testbed(cfg, run, bed, tok)
    assert res["model"] == "none" and res["n_flagged"] >= 0
    if tokenizer == "word":
        _audit_cli_on_user_files(tmp_path, run.dir)  # ``reprlab otcclip audit --run`` end to end


def test_audit_of_an_open_clip_run_without_open_clip_is_a_clean_error(tmp_path):
    try:
        import open_clip  # noqa: F401

        pytest.skip("open_clip imports here: tests/methods/otcclip/test_openclip.py covers the audit")
    except Exception:  # noqa: BLE001  (ImportError, or torchvision failing beside this torch)
        pass
    cfg = _cfg(["model.arch=open_clip:reprlab-tiny-vit"])
    run = Run.create(tmp_path / "r", cfg, "otcclip-mosaic-tiny", quiet=True)
    (run.dir / "checkpoints" / "otcclip" / "step_00000000").mkdir(parents=True)
    (run.dir / "checkpoints" / "otcclip" / "step_00000000" / "meta.json").write_text("{}")
    with pytest.raises(ModelNotAvailableError, match="open-clip-torch"):
        load_run_model(run.dir, "otcclip")


def test_in_memory_hf_clip_run_trains_with_its_tokenizer_folder(tmp_path, monkeypatch):
    """``model.tokenizer`` reaches the in-memory path too (it used to train hf_clip with our word tokenizer while
    the model pooled at an EOS id that tokenizer never emits); the audit then reads the same folder."""
    hf = _hf_clip_tokenizer(tmp_path)
    cfg = _cfg(
        [
            "model.arch=hf_clip",
            "model.image_size=28",
            "model.patch_size=7",
            f"model.tokenizer={tmp_path / 'tok'}",
            "defenses=[none]",
            "audit_defense=",
        ]
    )
    seen = {}

    def fake_train(defense, cfg, run, bed, tok, dist):
        seen["tok"] = tok
        return {"metrics": {}, "examples": []}

    monkeypatch.setattr(recipe, "train_defense", fake_train)
    run = Run.create(tmp_path / "r", cfg, "otcclip-mosaic-tiny", quiet=True)
    recipe.run(cfg, run)
    assert isinstance(seen["tok"], HFTokenizerAdapter)
    assert (
        seen["tok"].encode(["a bag top left"], 8)[0].tolist() == hf.encode(["a bag top left"], 8)[0].tolist()
    )
    assert not (run.dir / "artifacts" / "tokenizer.json").exists()


@pytest.mark.parametrize("entry", ["load_run_model", "export"])
def test_a_folder_without_config_is_not_a_run_folder(tmp_path, entry):
    """Every reader of a finished run (the audit's model loader, export, evaluate, the flag probe) goes through
    ``run_config``, which names the folder and the missing config.yaml instead of a bare FileNotFoundError."""
    from reprlab.errors import RunFolderError
    from reprlab.methods.otcclip import export as otc_export

    call = {
        "load_run_model": lambda: load_run_model(tmp_path, "otcclip"),
        "export": lambda: otc_export.export(tmp_path, "otcclip", {"open_clip": tmp_path / "out"}),
    }[entry]
    with pytest.raises(RunFolderError, match="not a run folder \\(no config.yaml\\)"):
        call()


def test_another_methods_run_or_a_missing_defense_is_named(tmp_path):
    """A run folder of another recipe is named as such (it said "unknown config key 'hidden'"), and a defense the
    run has no checkpoint of is named with the ones it has (it raised a bare FileNotFoundError)."""
    from reprlab.errors import RunFolderError
    from reprlab.recipes import get_recipe
    from reprlab.runs import Run

    smoke = get_recipe("smoke-digits")
    other = Run.create(tmp_path / "smoke", smoke.build_config(), "smoke-digits", quiet=True)
    with pytest.raises(
        RunFolderError, match=r"is not an otcclip run: its config.yaml \(recipe smoke-digits\)"
    ):
        load_run_model(other.dir, "otcclip")
    cfg = get_recipe("otcclip-mosaic-tiny").build_config()
    run = Run.create(tmp_path / "otc", cfg, "otcclip-mosaic-tiny", quiet=True)
    with pytest.raises(RunFolderError, match=r"has no checkpoint of defense 'otcclip'; it has none"):
        load_run_model(run.dir, "otcclip")
    # the word tokenizer's vocabulary missing from artifacts/: named (it was a FileNotFoundError traceback)
    from reprlab.methods.otcclip.models.run_model import run_tokenizer

    with pytest.raises(RunFolderError, match=r"artifacts/tokenizer.json is missing"):
        run_tokenizer(cfg, run.dir)
