"""model.arch=open_clip:<name> through OpenCLIPAdapter: global features are open_clip's own, patch and token
features are its last-layer tokens in the joint space, the model's preprocess_cfg is applied, training reduces the
loss, and two torchrun ranks on the shard path train like one process.

These run only where open-clip-torch imports: not beside the project's torch 2.13.0 CPU build (no torchvision
imports there), so in the main venv and CI they SKIP; run them in the side venv (scripts/openclip_env.sh):
``.venv-openclip/bin/python -m pytest tests/methods/otcclip/test_openclip.py -q`` (``make test-openclip``).
"""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

try:  # torchvision fails with a RuntimeError, not an ImportError, beside a mismatched torch
    import open_clip
except Exception as err:  # noqa: BLE001
    pytest.skip(f"open_clip does not import here ({type(err).__name__}): run in scripts/openclip_env.sh's venv",
                allow_module_level=True)  # fmt: skip

from reprlab.errors import ConfigError  # noqa: E402
from reprlab.methods.otcclip.config import (
    ModelConfig,  # noqa: E402
    TrainConfig,  # noqa: E402
)
from reprlab.methods.otcclip.data import shards as sh  # noqa: E402
from reprlab.methods.otcclip.data.testbed import build_testbed  # noqa: E402
from reprlab.methods.otcclip.models.build import build_model  # noqa: E402
from reprlab.methods.otcclip.models.openclip import (  # noqa: E402
    TINY_CONFIG,
    OpenCLIPAdapter,
    OpenCLIPTokenizer,
    attnpool_queries,
    create_openclip,
)
from reprlab.methods.otcclip.pipeline.audit import audit_testbed  # noqa: E402
from reprlab.methods.otcclip.training.trainer import Trainer  # noqa: E402
from tests.methods.otcclip.test_trainer import DCFG, _data  # noqa: E402
from tests.methods.otcclip.torchrun_compare import one_vs_two_ranks  # noqa: E402

HERE = Path(__file__).parent
TINY = ModelConfig(arch="open_clip:reprlab-tiny-vit")
CAPTIONS = [
    "a sneaker top left, a bag bottom right",
    "a bag",
    "a t-shirt on the left and a coat on the right",
]


def _tiny(seed=0):
    torch.manual_seed(seed)
    return build_model(TINY, 0).eval()


def _model_norm(model, x):
    """Pixels in [-1, 1] mapped by hand to the model's preprocess_cfg mean/std (open_clip's Normalize)."""
    pp = open_clip.get_model_preprocess_cfg(model.clip)
    mean, std = (torch.tensor(pp[k]).view(1, 3, 1, 1) for k in ("mean", "std"))
    return ((x.expand(-1, 3, -1, -1) + 1) / 2 - mean) / std


def test_global_features_are_open_clips_own_and_fine_features_its_last_layer_tokens():
    model = _tiny()
    assert isinstance(model, OpenCLIPAdapter) and model.cfg.max_len == 32 and model.cfg.embed_dim == 64
    tok = OpenCLIPTokenizer.for_config(TINY)
    ids, mask = tok.encode(CAPTIONS, model.cfg.max_len)
    x = torch.rand(3, 1, 56, 56) * 2 - 1  # greyscale in [-1, 1], as the trainer feeds mosaics
    with torch.no_grad():
        img, txt = model.encode_image(x), model.encode_text(ids, mask)
        xn = _model_norm(model, x)
        ref_img = F.normalize(model.clip.encode_image(xn), dim=-1)
        ref_txt = F.normalize(model.clip.encode_text(ids), dim=-1)
        # oracle for the fine features: open_clip's own intermediates of the last block, with its final norms
        inter = model.clip.forward_intermediates(image=xn, text=ids, image_indices=1, text_indices=1,
                                                 normalize_intermediates=True, intermediates_only=True)  # fmt: skip
        grid = inter["image_intermediates"][-1].flatten(2).transpose(1, 2)  # (3, 16, width) after ln_post
        ref_patches = F.normalize(grid @ model.clip.visual.proj, dim=-1)
        ref_tokens = F.normalize(inter["text_intermediates"][-1] @ model.clip.text_projection, dim=-1)
    assert torch.allclose(img.global_, ref_img, atol=1e-6)
    assert torch.allclose(txt.global_, ref_txt, atol=1e-6)
    assert img.patches.shape == (3, 16, 64) and img.mask.shape == (3, 16) and bool(img.mask.all())
    assert torch.allclose(img.patches, ref_patches, atol=1e-5)
    assert txt.tokens.shape == (3, 32, 64) and torch.equal(txt.mask, ids != 0)
    m = mask.unsqueeze(-1)
    assert torch.allclose(txt.tokens * m, ref_tokens * m, atol=1e-5)
    assert float(txt.tokens[~mask].abs().max()) == 0.0  # padding zeroed
    assert torch.allclose(txt.tokens[mask].norm(dim=-1), torch.ones(int(mask.sum())), atol=1e-5)
    # the tokenizer is open_clip's BPE: SOT + words + EOT, padded with 0, and it decodes back
    assert ids[0, 0] == tok.tokenizer.sot_token_id and ids[1, :4].tolist()[-1] == tok.tokenizer.eot_token_id
    assert tok.decode(ids)[1] == "a bag" and len(tok) == 49408


def test_shorter_ids_are_padded_to_the_context_and_give_the_same_features():
    """The evaluation encodes prompts at model.max_len; open_clip adds all context positions: the adapter pads."""
    model = _tiny()
    tok = OpenCLIPTokenizer.for_config(TINY)
    ids, mask = tok.encode(CAPTIONS, 32)
    short = model.encode_text(ids[:, :16], mask[:, :16])
    full = model.encode_text(ids, mask)
    assert torch.allclose(short.global_, full.global_, atol=1e-6)
    assert torch.allclose(short.tokens, full.tokens[:, :16], atol=1e-6)


def test_the_models_preprocess_cfg_mean_and_std_are_applied(tmp_path):
    """A config carrying its own preprocess_cfg (open_clip_config.json format): the adapter maps [-1, 1] pixels with
    that mean/std; with OpenAI's (the default) or none, the features differ."""
    cfg = json.loads(TINY_CONFIG.read_text())
    pp = {"mean": [0.1, 0.2, 0.3], "std": [0.5, 0.6, 0.7]}
    path = tmp_path / "custom-pp.json"
    path.write_text(json.dumps({"model_cfg": cfg, "preprocess_cfg": pp}))
    torch.manual_seed(0)
    model = build_model(ModelConfig(arch=f"open_clip:{path}"), 0).eval()
    assert model.preprocess_cfg["mean"] == (0.1, 0.2, 0.3) or list(model.preprocess_cfg["mean"]) == pp["mean"]
    x = torch.rand(2, 3, 56, 56) * 2 - 1
    mean, std = (torch.tensor(pp[k]).view(1, 3, 1, 1) for k in ("mean", "std"))
    with torch.no_grad():
        got = model.encode_image(x).global_
        want = F.normalize(model.clip.encode_image(((x + 1) / 2 - mean) / std), dim=-1)
        raw = F.normalize(model.clip.encode_image(x), dim=-1)
        openai = F.normalize(model.clip.encode_image(_model_norm(_tiny(), x)), dim=-1)
    assert torch.allclose(got, want, atol=1e-6)
    assert not torch.allclose(got, raw, atol=1e-3) and not torch.allclose(got, openai, atol=1e-3)
    # the packaged tiny config takes open_clip's default (OpenAI CLIP's) statistics
    assert tuple(_tiny().preprocess_cfg["mean"]) == open_clip.OPENAI_DATASET_MEAN


def test_resnet_tower_patches_are_the_attention_pools_spatial_outputs(tmp_path):
    """ModifiedResNet (RN50's family, tiny): global = open_clip's own; patches = the attention pool's other queries,
    whose first query reproduces open_clip's pooled output (so they are the same attention)."""
    cfg = {"embed_dim": 32, "vision_cfg": {"image_size": 64, "layers": [1, 1, 1, 1], "width": 8, "patch_size": None},
           "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}}  # fmt: skip
    path = tmp_path / "tiny-rn.json"
    path.write_text(json.dumps(cfg))
    torch.manual_seed(0)
    model = build_model(ModelConfig(arch=f"open_clip:{path}"), 0).eval()
    assert model.tower == "resnet"
    x = torch.rand(2, 3, 64, 64) * 2 - 1
    with torch.no_grad():
        f = model.encode_image(x)
        xn = _model_norm(model, x)
        vis = model.clip.visual
        feat = vis.layer4(vis.layer3(vis.layer2(vis.layer1(vis.stem(xn)))))
        rows = attnpool_queries(vis.attnpool, feat)
        own = model.clip.encode_image(xn)
    assert f.patches.shape == (2, 4, 32)  # 64 px / 32 = a 2x2 grid
    assert torch.allclose(rows[:, 0], own, atol=1e-5)
    assert torch.allclose(f.global_, F.normalize(own, dim=-1), atol=1e-6)
    assert torch.allclose(f.patches, F.normalize(rows[:, 1:], dim=-1), atol=1e-6)
    assert not torch.allclose(f.patches[:, 0], f.patches[:, 1], atol=1e-3)  # spatial, not one vector repeated


def test_unsupported_towers_names_and_weights_fail_clearly(tmp_path):
    cfg = json.loads(TINY_CONFIG.read_text())
    cfg["vision_cfg"].update(attentional_pool=True, attn_pooler_queries=4, attn_pooler_heads=2)
    path = tmp_path / "coca-like.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="supported towers: image: open_clip VisionTransformer"):
        build_model(ModelConfig(arch=f"open_clip:{path}"), 0)
    with pytest.raises(ConfigError, match="not an open_clip model config.*list_models"):
        build_model(ModelConfig(arch="open_clip:ViT-Nope-99"), 0)
    with pytest.raises(ConfigError, match="hub models are not downloaded"):
        build_model(ModelConfig(arch="open_clip:hf-hub:timm/ViT-B-32"), 0)
    with pytest.raises(ConfigError, match="model.pretrained 'openai' is not a file"):
        build_model(ModelConfig(arch="open_clip:reprlab-tiny-vit", pretrained="openai"), 0)


def test_weights_load_from_a_local_file(tmp_path):
    a = _tiny(seed=1)
    ckpt = tmp_path / "tiny.pt"
    torch.save(a.clip.state_dict(), ckpt)
    torch.manual_seed(2)
    b = build_model(ModelConfig(arch="open_clip:reprlab-tiny-vit", pretrained=str(ckpt)), 0)
    c = create_openclip("reprlab-tiny-vit")
    for (name, p), q in zip(a.clip.state_dict().items(), b.clip.state_dict().values()):
        assert torch.equal(p, q), name
    assert any(not torch.equal(p, r) for p, r in zip(a.clip.parameters(), c.parameters()))


def test_a_few_otcclip_epochs_reduce_the_loss_and_reach_patch_and_token_features(items):
    """The in-memory trainer on the adapter: plain epoch, OT-loss epoch, re-matching epoch; the loss falls and the
    OT terms backpropagate into the ViT and text blocks."""
    data = _data(items, 32)
    tok = OpenCLIPTokenizer.for_config(TINY)
    torch.manual_seed(0)
    model = build_model(TINY, len(tok))
    tr = Trainer(
        model, data, tok, "otcclip", TrainConfig(epochs=4, batch_size=8, warmup_steps=2, lr=2e-3), DCFG, 0
    )
    stats = [tr.run_epoch(e) for e in range(4)]
    assert stats[-1]["loss_clip"] < stats[0]["loss_clip"] - 0.05, [s["loss_clip"] for s in stats]
    assert any("rematch_poison_moved" in s for s in stats)
    ot = [k for k in stats[-1] if k.startswith("loss_") and k != "loss_clip"]
    assert ot, stats[-1]
    # one step of the OT terms alone moves the last blocks' weights of both towers (patch and token features)
    ids, mask = tok.encode(data.captions[:8], model.cfg.max_len)
    from reprlab.methods.otcclip.config import OTConfig
    from reprlab.methods.otcclip.defenses.losses import ot_alignment

    img = model.encode_image(data.images[:8].float() / 127.5 - 1)
    txt = model.encode_text(ids, mask)
    model.zero_grad()
    ot_alignment(img.patches, txt.tokens, img.mask, txt.mask, OTConfig(n_iters=20)).backward()
    vis_block = model.clip.visual.transformer.resblocks[-1].mlp.c_fc.weight.grad
    txt_block = model.clip.transformer.resblocks[-1].mlp.c_fc.weight.grad
    assert vis_block is not None and float(vis_block.abs().sum()) > 0
    assert txt_block is not None and float(txt_block.abs().sum()) > 0


def test_two_torchrun_ranks_on_the_shard_path_train_the_open_clip_model_like_one_process(items, tmp_path):
    """As test_stream.py's torchrun test, on reprlab-tiny-vit through the adapter: OTCCLIP over shards, 2 epochs
    (plain + OT losses, then re-matching over the caption bank gathered from all ranks), 4 slots; one process with
    2 DataLoader workers against torchrun with 2 gloo ranks x 1 worker."""
    pairs = _data(items, 32)
    sh.write_shards(pairs, tmp_path / "shards", shard_size=4)
    one, two = one_vs_two_ranks(
        HERE / "stream_worker.py",
        tmp_path / "shards",
        tmp_path,
        timeout=900,
        extra=("open_clip:reprlab-tiny-vit",),
    )
    moved, worst = 0.0, 0.0
    for name, w in one["state"].items():
        diff = float((two["state"][name] - w).abs().max())
        worst = max(worst, diff)
        assert diff <= 1e-4, (name, diff)
        moved += float((w - one["init"][name]).abs().sum())
    print(f"torchrun vs one process: max weight difference {worst:.2e}, total weight move {moved:.3g}")
    assert moved > 1e-2  # training changed the weights: the comparison is not vacuous


def test_the_openclip_recipe_runs_end_to_end_on_a_miniature(tmp_path):
    """otcclip-openclip-tiny through recipe.run (preflight, shards stage, open_clip tokenizer, streamed training,
    evaluation) on a miniature of its testbed; every defense reports its metrics."""
    import yaml

    from reprlab.config import load_config
    from reprlab.methods.otcclip import recipe
    from reprlab.runs import Run

    path = Path(recipe.__file__).parent / "recipes" / "otcclip-openclip-tiny.yaml"
    mini = ["data.n_pairs=160", "data.captions_per_target=4", "data.n_targets=2", "data.backdoor_pairs=8",
            "data.n_eval=60", "data.n_probe_train=60", "train.epochs=2", "train.batch_size=20",
            "defense.rematch_warmup=1", "defense.rematch_every=1", "defense.safeclip_unimodal_epochs=0",
            "defense.ot.n_iters=10", "defense.bank_size=64", "stream.shard_size=42", "stream.num_workers=1"]  # fmt: skip
    cfg = load_config(recipe.Config, yaml.safe_load(path.read_text())["config"], mini)
    assert cfg.model.arch == "open_clip:reprlab-tiny-vit" and cfg.stream.write_shards
    recipe.preflight(cfg)
    run = Run.create(tmp_path / "r", cfg, "otcclip-openclip-tiny", quiet=True)
    summary = recipe.run(cfg, run)
    for d in cfg.defenses:
        for k in ("zeroshot_acc", "linear_probe_acc", "asr_targeted", "asr_backdoor"):
            assert 0.0 <= summary[f"{d}.{k}"] <= 1.0, (d, k)
    assert summary["otcclip.rematch_poison_moved"] >= 0.0 and summary["n_pairs"] == 168
    data = json.loads((run.dir / "analysis" / "data.json").read_text())
    assert data["vocab"] == 49408  # open_clip's BPE tokenizer, not a word vocabulary built from the captions


def test_word_dropout_keeps_open_clips_sot_and_eot_where_its_pooling_reads():
    """open_clip's text tower pools at argmax(ids) = EOT: dropout at p = 0.9 keeps SOT first and EOT right after
    the last kept word, so the pooled feature is the EOT's (oracle: open_clip's encode_text on the kept ids)."""
    from reprlab.methods.otcclip.training.augment import drop_words
    from tests.methods.otcclip.test_special_tokens import CAPTIONS as CAPS
    from tests.methods.otcclip.test_special_tokens import _check_kept_in_place

    tok = OpenCLIPTokenizer.for_config(TINY)
    sot, eot = tok.tokenizer.sot_token_id, tok.tokenizer.eot_token_id
    assert {sot, eot} <= set(tok.special_ids) and 0 not in tok.special_ids
    model = _tiny()
    ids, mask = tok.encode(CAPS, model.cfg.max_len)
    new, new_mask = drop_words(ids, mask, torch.Generator().manual_seed(0), 0.9, tok.special_ids)
    _check_kept_in_place(ids, mask, new, new_mask, sot, eot)
    with torch.no_grad():
        got = model.encode_text(new, new_mask)
        h = []
        handle = model._ln_final.register_forward_hook(lambda _m, _a, out: h.append(out))
        model.clip.encode_text(new)
        handle.remove()
    eot_feat = F.normalize(h[0][torch.arange(len(new)), new_mask.sum(1) - 1] @ model._text_proj, dim=-1)
    assert torch.allclose(got.global_, eot_feat, atol=1e-5)


def test_audit_of_an_open_clip_run_rebuilds_its_open_clip_model(tmp_path):
    """``reprlab otcclip audit --run`` and the recipe's testbed audit on an ``open_clip:<name>`` run: its
    OpenCLIPAdapter and open_clip tokenizer with the checkpoint's weights (the streamed run saves no
    tokenizer.json), not a TinyCLIP."""
    import yaml

    from reprlab.config import load_config
    from reprlab.methods.otcclip import recipe
    from reprlab.methods.otcclip.evaluation.audit import audit_pairs
    from reprlab.methods.otcclip.models.run_model import load_run_model
    from reprlab.runs import Run

    path = Path(recipe.__file__).parent / "recipes" / "otcclip-openclip-tiny.yaml"
    mini = ["data.n_pairs=160", "data.captions_per_target=4", "data.n_targets=2", "data.backdoor_pairs=8",
            "data.n_eval=60", "data.n_probe_train=60", "defense.ot.n_iters=10", "audit_defense=otcclip"]  # fmt: skip
    cfg = load_config(recipe.Config, yaml.safe_load(path.read_text())["config"], mini)
    run = Run.create(tmp_path / "r", cfg, "otcclip-openclip-tiny", quiet=True)
    bed = build_testbed(cfg.data, cfg.seed)
    torch.manual_seed(5)
    trained = build_model(cfg.model, 0, bed.pairs.images.shape[1])
    run.save_checkpoint(0, {"model": trained}, tag="otcclip")
    model, tok, got_cfg = load_run_model(run.dir, "otcclip")
    assert isinstance(model, OpenCLIPAdapter) and isinstance(tok, OpenCLIPTokenizer)
    want = trained.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
    sub = bed.pairs
    a = audit_pairs(model, tok, sub, top_k=4)
    b = audit_pairs(trained, OpenCLIPTokenizer.for_config(cfg.model), sub, top_k=4)
    assert (a.score == b.score).all()
    res = audit_testbed(cfg, run, bed, tok)
    assert res["model"] == "otcclip" and res["n_flagged"] >= 0
