"""``reprlab export RUN --stage <defense> --hf OUT``: a trained ``hf_clip`` run loads with
``transformers.CLIPModel.from_pretrained`` (and ``CLIPProcessor``) and gives reprlab's own features and logits; the
tiny arch and a format that is not the run's say why; an unfinished defense is named. (open_clip: in
test_export_openclip.py, which runs where open_clip imports.)"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from reprlab.errors import ConfigError, RunFolderError
from reprlab.export import export_run
from reprlab.methods.otcclip.data.transforms import to_input
from reprlab.methods.otcclip.models.build import build_model
from reprlab.methods.otcclip.models.export import NoThirdPartyFormat
from reprlab.methods.otcclip.models.features import LOGIT_SCALE_MAX, clip_pixels
from reprlab.runs import Run
from tests.methods.otcclip.test_audit_arch import _hf_run
from tests.methods.otcclip.test_recipe import _cfg

CAPTIONS = ["a bag top left", "a coat", "a sneaker and a bag", "a shirt bottom right"]


def _finish(run, defense="none"):
    run.stage(defense, lambda: {"metrics": {}, "examples": []})  # the stage marker a finished defense leaves


def _cli(*args):
    from typer.testing import CliRunner

    from reprlab.cli import app

    return CliRunner().invoke(app, ["export", *map(str, args)])


@pytest.mark.parametrize("tokenizer", ["hf", "word"])
def test_hf_export_loads_in_transformers_with_reprlabs_features_and_logits(tmp_path, tokenizer):
    from transformers import CLIPImageProcessor, CLIPModel

    cfg, run, bed, tok, model = _hf_run(tmp_path, tokenizer)
    with torch.no_grad():
        model.clip.logit_scale.fill_(
            5.0
        )  # above the trainer's clamp: the export must carry the clamped scale
    run.save_checkpoint(1, {"model": model}, tag="none")
    _finish(run)
    out = tmp_path / "hf"
    res = _cli(run.dir, "--stage", "none", "--hf", out)
    assert res.exit_code == 0, res.output
    model.eval()
    loaded = CLIPModel.from_pretrained(out).eval()  # the third-party loader, from the folder alone
    proc = CLIPImageProcessor.from_pretrained(out)
    assert proc.crop_size == {"height": 28, "width": 28}
    x = to_input(bed.pairs.images[:4])
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in (proc.image_mean, proc.image_std))
    pixels = clip_pixels(x, mean, std, 28, True)  # [-1, 1] -> the saved processor's normalisation
    ids, mask = tok.encode(CAPTIONS, cfg.model.max_len)
    with torch.no_grad():
        got = loaded(input_ids=ids, pixel_values=pixels, attention_mask=mask.long())
        img, txt = model.encode_image(x), model.encode_text(ids, mask)
        h = loaded.text_model(input_ids=ids, attention_mask=mask.long()).last_hidden_state
    # two code paths over the same fp32 weights (the adapter's and transformers' forward): 1e-5
    assert torch.allclose(got.image_embeds, img.global_, atol=1e-5)
    assert float(loaded.logit_scale.detach()) == pytest.approx(LOGIT_SCALE_MAX)
    info = json.loads((out / "reprlab_export.json").read_text())
    if tokenizer == "hf":
        from transformers import CLIPProcessor

        assert torch.allclose(got.text_embeds, txt.global_, atol=1e-5)
        want = model.scale() * img.global_ @ txt.global_.T
        assert torch.allclose(got.logits_per_image, want, rtol=1e-5, atol=1e-5)
        again = CLIPProcessor.from_pretrained(out).tokenizer(
            CAPTIONS, padding="max_length", max_length=cfg.model.max_len, truncation=True, return_tensors="pt"
        )
        assert torch.equal(again["input_ids"], ids)  # the run's tokenizer travels with the model
        assert info["text_pool"] == "eos"
    else:
        # the word tokenizer has no EOS: the run mean-pools projected tokens, CLIPModel pools at eos_token_id;
        # the text tower's states carry over and pool by hand to reprlab's text feature
        tokens = loaded.text_projection(h)
        w = mask.unsqueeze(-1).float()
        pooled = F.normalize((tokens * w).sum(1) / w.sum(1), dim=-1)
        assert torch.allclose(pooled, txt.global_, atol=1e-5)
        assert info["text_pool"] == "mean" and "get_text_features" in info["text_features"]
        assert json.loads((out / "reprlab_word_vocab.json").read_text()) == json.loads(
            (run.dir / "artifacts" / "tokenizer.json").read_text()
        )
    assert not list(tmp_path.glob(".tmp_hf_*"))  # written under a temporary name, then renamed


def test_tiny_arch_has_no_third_party_format_and_formats_must_match_the_arch(tmp_path):
    cfg = _cfg()  # model.arch=tiny
    run = Run.create(tmp_path / "r", cfg, "otcclip-mosaic-tiny", quiet=True)
    torch.manual_seed(0)
    run.save_checkpoint(0, {"model": build_model(cfg.model, 10, 1)}, tag="otcclip")
    _finish(run, "otcclip")
    with pytest.raises(NoThirdPartyFormat, match="tiny ViT: neither open_clip nor transformers"):
        export_run(run.dir, "otcclip", {"hf": tmp_path / "x"})
    res = _cli(run.dir, "--stage", "otcclip", "--open-clip", tmp_path / "y")
    assert res.exit_code == 2 and "no --open-clip or --hf export" in res.output
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
    (tmp_path / "h").mkdir()
    _, hf_run, *_ = _hf_run(tmp_path / "h", "word")
    _finish(hf_run)
    with pytest.raises(ConfigError, match="exports as --hf only.*--open-clip"):
        export_run(hf_run.dir, "none", {"open_clip": tmp_path / "z"})
    with pytest.raises(RunFolderError, match="no finished 'otcclip' defense.*trained: none"):
        export_run(hf_run.dir, "otcclip", {"hf": tmp_path / "z"})
    with pytest.raises(ConfigError, match="valid stages: .*otcclip"):
        export_run(hf_run.dir, "clip", {"hf": tmp_path / "z"})
    with pytest.raises(ConfigError, match="nothing to export") as err:
        export_run(hf_run.dir, "none", {})
    assert err.value.hint == "options: --open-clip OUT, --hf OUT"
