"""``reprlab export RUN --stage <defense> --open-clip OUT``: a trained ``open_clip:<name>`` run loads with open_clip's
own ``create_model_and_transforms("local-dir:OUT")`` and ``get_tokenizer`` and gives reprlab's features and logits.

Runs only where open-clip-torch imports (not beside the project's torch 2.13.0 CPU build: it SKIPS in the main venv
and CI); run it in the side venv: ``make test-openclip`` (scripts/openclip_env.sh).
"""

from __future__ import annotations

import json

import pytest
import torch

try:  # torchvision fails with a RuntimeError, not an ImportError, beside a mismatched torch
    import open_clip
except Exception as err:  # noqa: BLE001
    pytest.skip(f"open_clip does not import here ({type(err).__name__}): run in scripts/openclip_env.sh's venv",
                allow_module_level=True)  # fmt: skip

from reprlab.export import export_run  # noqa: E402
from reprlab.methods.otcclip.data.testbed import build_testbed  # noqa: E402
from reprlab.methods.otcclip.data.transforms import to_input  # noqa: E402
from reprlab.methods.otcclip.models.build import build_model, build_tokenizer  # noqa: E402
from reprlab.methods.otcclip.models.features import LOGIT_SCALE_MAX, clip_pixels  # noqa: E402
from reprlab.runs import Run  # noqa: E402
from tests.methods.otcclip.test_recipe import _cfg  # noqa: E402

CAPTIONS = ["a bag top left", "a coat", "a sneaker and a bag", "a shirt bottom right"]


def test_open_clip_export_loads_in_open_clip_with_reprlabs_features_and_logits(tmp_path):
    cfg = _cfg(["model.arch=open_clip:reprlab-tiny-vit"])
    run = Run.create(tmp_path / "r", cfg, "otcclip-mosaic-tiny", quiet=True)
    bed = build_testbed(cfg.data, cfg.seed)
    torch.manual_seed(3)
    model = build_model(cfg.model, 0, bed.pairs.images.shape[1])
    with torch.no_grad():
        model.clip.logit_scale.fill_(5.0)  # above the trainer's clamp: the export carries the clamped scale
    run.save_checkpoint(1, {"model": model}, tag="otcclip")
    run.stage("otcclip", lambda: {"metrics": {}, "examples": []})
    out = tmp_path / "oc"
    assert export_run(run.dir, "otcclip", {"open_clip": out}) == {"open_clip": out}
    assert json.loads((out / "open_clip_config.json").read_text())["model_cfg"]["embed_dim"] > 0
    # open_clip's own loader, from the folder alone
    loaded, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{out}")
    loaded.eval()
    model.eval()
    oc_tok = open_clip.get_tokenizer(f"local-dir:{out}")
    pp = open_clip.get_model_preprocess_cfg(loaded)
    assert pp["size"] == model.preprocess_cfg["size"]
    mean, std = (torch.tensor(pp[k]).view(1, 3, 1, 1) for k in ("mean", "std"))
    x = to_input(bed.pairs.images[:4])
    pixels = clip_pixels(x, mean, std, model.image_size, True)  # [-1, 1] -> the export's preprocess_cfg
    tok = build_tokenizer(cfg.model)
    ids, mask = tok.encode(CAPTIONS, model.cfg.max_len)
    assert torch.equal(oc_tok(CAPTIONS).long(), ids)  # open_clip's tokenizer for the folder is the run's
    with torch.no_grad():
        img_f = loaded.encode_image(pixels, normalize=True)
        txt_f = loaded.encode_text(oc_tok(CAPTIONS), normalize=True)
        img, txt = model.encode_image(x), model.encode_text(ids, mask)
    # two code paths over the same fp32 weights (the adapter's hooks and open_clip's forward): 1e-5
    assert torch.allclose(img_f, img.global_, atol=1e-5)
    assert torch.allclose(txt_f, txt.global_, atol=1e-5)
    assert float(loaded.logit_scale.detach()) == pytest.approx(LOGIT_SCALE_MAX)
    logits = loaded.logit_scale.exp() * img_f @ txt_f.T
    assert torch.allclose(logits, model.scale() * img.global_ @ txt.global_.T, rtol=1e-5, atol=1e-5)
