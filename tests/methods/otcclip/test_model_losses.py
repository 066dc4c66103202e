"""TinyCLIP features, the HF adapter, and the loss formulas."""

import math

import torch
import torch.nn.functional as F

from reprlab.methods.otcclip.config import ModelConfig, OTConfig
from reprlab.methods.otcclip.defenses.losses import clip_loss, ot_alignment, unimodal_loss
from reprlab.methods.otcclip.models.tiny import TinyCLIP

CFG = ModelConfig(
    patch_size=14,
    width=32,
    layers=1,
    heads=2,
    text_width=32,
    text_layers=1,
    text_heads=2,
    max_len=12,
    embed_dim=16,
)


def test_tiny_clip_shapes_normalisation_and_padding_invariance():
    torch.manual_seed(0)
    m = TinyCLIP(CFG, vocab_size=20).eval()
    img = m.encode_image(torch.randn(3, 1, 56, 56))
    assert img.global_.shape == (3, 16) and img.patches.shape == (3, 16, 16)
    assert torch.allclose(img.patches.norm(dim=-1), torch.ones(3, 16), atol=1e-5)  # unit vectors
    ids = torch.tensor([[3, 4, 5, 0, 0, 0]])
    a = m.encode_text(ids, ids != 0)
    b = m.encode_text(ids[:, :3], ids[:, :3] != 0)
    # padding is masked out of attention and pooling: same global feature with or without it
    assert torch.allclose(a.global_, b.global_, atol=1e-5)
    assert (a.tokens[0, 3:] == 0).all() and torch.allclose(a.tokens[0, :3], b.tokens[0], atol=1e-5)
    assert torch.isclose(m.scale(), torch.tensor(1 / 0.07), rtol=1e-5)
    m.logit_scale.data.fill_(10.0)
    assert torch.isclose(m.scale(), torch.tensor(100.0), rtol=1e-5)  # clamped at ln 100


def test_clip_loss_matches_the_written_formula_and_known_answers():
    torch.manual_seed(0)
    u, w = F.normalize(torch.randn(5, 8), dim=-1), F.normalize(torch.randn(5, 8), dim=-1)
    s = torch.tensor(7.0)
    logits = s * u @ w.T
    rows = -torch.log_softmax(logits, 1).diagonal().mean()
    cols = -torch.log_softmax(logits, 0).diagonal().mean()
    assert torch.isclose(clip_loss(u, w, s), 0.5 * (rows + cols), atol=1e-6)
    # identical embeddings and zero scale: uniform softmax, loss = ln(batch)
    assert torch.isclose(clip_loss(u, u, torch.tensor(0.0)), torch.tensor(math.log(5)), atol=1e-6)
    e = torch.eye(4)
    assert unimodal_loss(e, e, temperature=0.01) < 1e-6  # orthogonal positives, sharp temperature


def test_ot_alignment_is_zero_on_identical_sets_and_has_gradient():
    torch.manual_seed(0)
    x = F.normalize(torch.randn(2, 4, 8), dim=-1)
    cfg = OTConfig(eps=0.01, n_iters=200)
    # identical supports: the (near-)identity plan costs ~0; tolerance is the entropic blur at eps=0.01
    assert ot_alignment(x, x, None, None, cfg) < 0.02
    y = F.normalize(torch.randn(2, 5, 8), dim=-1).requires_grad_()
    loss = ot_alignment(x, y, None, torch.tensor([[1, 1, 1, 0, 0], [1] * 5]).bool(), cfg)
    loss.backward()
    assert torch.isfinite(y.grad).all() and (y.grad[0, 3:] == 0).all()  # padded tokens get no gradient
    assert y.grad[0, :3].abs().sum() > 0


def test_hf_clip_adapter_on_tiny_random_config():
    from transformers import CLIPConfig, CLIPModel

    from reprlab.methods.otcclip.models.hf import HFCLIPAdapter

    cfg = CLIPConfig(
        text_config=dict(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=16,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=2,
        ),
        vision_config=dict(
            image_size=32,
            patch_size=8,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
        ),
        projection_dim=16,
    )
    torch.manual_seed(0)
    clip = CLIPModel(cfg).eval()
    ad = HFCLIPAdapter(clip)
    ids = torch.randint(3, 64, (4, 12))
    ids[:, -1] = 1
    mask = torch.ones_like(ids, dtype=torch.bool)
    pix = torch.randn(4, 3, 32, 32)
    img, txt = ad.encode_image(pix), ad.encode_text(ids, mask)
    assert img.patches.shape == (4, 16, 16) and txt.tokens.shape == (4, 12, 16)
    # the global features are exactly HF's own image/text embeddings (oracle: CLIPModel.forward)
    with torch.no_grad():
        out = clip(input_ids=ids, pixel_values=pix, attention_mask=mask.long(), return_loss=True)
    assert torch.allclose(img.global_, F.normalize(out.image_embeds, dim=-1), atol=1e-5)
    assert torch.allclose(txt.global_, F.normalize(out.text_embeds, dim=-1), atol=1e-5)
    # greyscale 56 px input is converted and resized rather than rejected
    assert ad.encode_image(torch.randn(2, 1, 56, 56)).patches.shape == (2, 16, 16)
    # the same CLIP loss the trainer uses reproduces HF's contrastive loss
    loss = clip_loss(img.global_, txt.global_, ad.scale())
    assert torch.isclose(loss, out.loss, atol=1e-5)
