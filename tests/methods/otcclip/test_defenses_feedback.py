"""The fourth ablation pass's options [ours] (docs/otcclip_ablation.md), each checked against a hand-computed
answer on the planted problem (``planted.py``) or a manual forward:

* ``own_negatives``: the own caption (``mask_own``; also its bank copies) or every exact-duplicate caption
  (``mask_text``) is removed from its image's negatives, in both directions, and nothing else is;
* ``reassigned_weight``: re-assigned pairs' CLIP terms are scaled, kept pairs' are not;
* ``match_schedule='epoch_start'``: the assignment is computed once per matching epoch and held fixed;
* ``model.feature_layer``: -1 is the default, an earlier block gives the fine-grained features through the
  same LayerNorm and projection while the global embeddings stay the last block's.

Checked by breaking each on purpose (then restoring it): mask off / transposed / bank mirror not updated,
weight applied to kept rows instead, per-step re-matching under ``epoch_start``, feature layer off by one.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from reprlab.methods.otcclip.config import ModelConfig, OTConfig
from reprlab.methods.otcclip.defenses.losses import clip_loss, ot_alignment, ot_alignments
from reprlab.methods.otcclip.models.tiny import TinyCLIP
from reprlab.methods.otcclip.training.trainer import Trainer

from .planted import DIM, image_class
from .test_defenses import _planted as _planted_defense

POISON = torch.arange(16) >= 12
ALL = torch.arange(16)


def _planted(**dcfg) -> Trainer:
    """OTCCLIP on test_defenses.py's planted problem, with an explicit keep margin."""
    return _planted_defense("otcclip", **{"keep_margin": 0.05, **dcfg})


def _oracle(u, w, scale, mask=None, weight=None) -> float:
    """Symmetric InfoNCE written out with loops, float64: logits (i, j) with ``mask[i, j]`` are skipped in row
    i's and column j's softmax; pair i's two terms are multiplied by ``weight[i]``."""
    logits = scale * u.double() @ w.double().T
    n = len(logits)
    mask = torch.zeros(n, n, dtype=torch.bool) if mask is None else mask
    weight = torch.ones(n) if weight is None else weight
    rows = cols = 0.0
    for i in range(n):
        row = torch.stack([logits[i, j] for j in range(n) if not mask[i, j]])
        col = torch.stack([logits[j, i] for j in range(n) if not mask[j, i]])
        rows += float(weight[i]) * float(torch.logsumexp(row, 0) - logits[i, i])
        cols += float(weight[i]) * float(torch.logsumexp(col, 0) - logits[i, i])
    return 0.5 * (rows + cols) / n


def _features(tr):
    """Image one-hots u and the planted assignment's caption one-hots (every image ends on its true class)."""
    u = F.one_hot(image_class(tr.data), DIM).float()
    return u, u.clone()


# ---------------------------------------------------------------------------------- own_negatives
def test_clip_loss_mask_and_weight_match_the_written_out_loss():
    g = torch.Generator().manual_seed(0)
    u = F.normalize(torch.randn(6, 5, generator=g), dim=-1)
    w = F.normalize(torch.randn(6, 5, generator=g), dim=-1)
    mask = torch.zeros(6, 6, dtype=torch.bool)
    mask[0, 3] = mask[2, 5] = mask[4, 1] = True
    weight = torch.tensor([1.0, 0.2, 1.0, 0.0, 0.5, 1.0])
    scale = torch.tensor(7.0)
    assert float(clip_loss(u, w, scale)) == pytest.approx(_oracle(u, w, 7.0), abs=1e-5)
    assert float(clip_loss(u, w, scale, mask)) == pytest.approx(_oracle(u, w, 7.0, mask), abs=1e-5)
    got = float(clip_loss(u, w, scale, mask, weight))
    assert got == pytest.approx(_oracle(u, w, 7.0, mask, weight), abs=1e-5)
    assert abs(_oracle(u, w, 7.0, mask) - _oracle(u, w, 7.0)) > 1e-3  # the mask is visible
    assert abs(_oracle(u, w, 7.0, mask) - _oracle(u, w, 7.0, mask.T)) > 1e-3  # and so is its direction
    with pytest.raises(ValueError):
        clip_loss(u, w, scale, torch.eye(6, dtype=torch.bool))


@pytest.mark.parametrize("mode", ["mask_own", "mask_text"])
def test_own_negatives_masks_exactly_the_own_caption_logits(mode):
    """Planted: the 4 poisons (cat images, dog captions) are re-assigned to a clean cat caption; that caption is
    the own caption of a clean cat image, which would be a negative 4 more times. ``mask_own`` removes exactly
    those logits; ``mask_text`` also removes captions with the same raw text as the own caption (the poisons'
    dog captions copy clean dog captions word for word)."""
    tr = _planted(own_negatives=mode)
    scale = float(tr.model.scale().detach())
    out = tr.step(ALL, 0, 0, "otc_match")
    got = out.assignment.index  # pool indices < 16: batch rows = training pairs
    assert torch.equal(got[~POISON], torch.arange(12)) and (image_class(tr.data)[got[POISON]] == 0).all()
    caps = tr.data.captions
    key = (lambda a, b: a == b) if mode == "mask_own" else (lambda a, b: caps[a] == caps[b])
    mask = torch.tensor([[i != j and key(i, int(got[j])) for j in range(16)] for i in range(16)])
    assert mask.any()
    if mode == "mask_text":  # a duplicate-text caption is masked only by mask_text
        own_only = torch.tensor([[i != j and i == int(got[j]) for j in range(16)] for i in range(16)])
        assert (mask & ~own_only).any()
    u, w = _features(tr)
    expected = _oracle(u, w, scale, mask)
    assert abs(expected - _oracle(u, w, scale)) > 0.01  # masking is visible in the loss
    assert float(out.loss) == pytest.approx(expected, abs=1e-5)


def test_own_negatives_recognises_bank_copies_of_the_own_caption():
    """Epoch 0 (not matching) fills the bank with the 16 captions; at epoch 1 the poisons may be re-assigned to a
    bank copy of a clean cat caption, which must be masked for that clean image exactly like the batch copy."""
    tr = _planted(own_negatives="mask_own", rematch_warmup=1, include_own=False, top_k=32)
    tr.step(ALL, 0, 0, "otc")
    scale = float(tr.model.scale().detach())
    out = tr.step(ALL, 1, 0, "otc_match")
    got = out.assignment.index
    pair = torch.where(got >= 16, got - 16, got)  # bank slot s holds training pair s (enqueued in order)
    assert (got[POISON] >= 16).any() or (got >= 16).any(), "the planted pool should pick some bank copies"
    mask = torch.tensor([[i != j and i == int(pair[j]) for j in range(16)] for i in range(16)])
    u = F.one_hot(image_class(tr.data), DIM).float()
    w = F.one_hot(tr.data.sig[pair], DIM).float()  # caption content of the assigned pair (oracle features)
    assert float(out.loss) == pytest.approx(_oracle(u, w, scale, mask), abs=1e-5)
    assert abs(_oracle(u, w, scale, mask) - _oracle(u, w, scale)) > 0.05


def test_own_negatives_bank_record_survives_a_resume():
    """The bank's record of which pair each slot came from is checkpointed with the bank: a trainer rebuilt from
    the modules' state after epoch 0 masks the same bank copies, so its first matching step has the same (masked)
    loss as the uninterrupted trainer's."""
    kw = dict(own_negatives="mask_own", rematch_warmup=1, include_own=False, top_k=32)
    straight = _planted(**kw)
    straight.step(ALL, 0, 0, "otc")
    saved = {k: {n: t.clone() for n, t in m.state_dict().items()} for k, m in straight.modules().items()}
    assert "loc" in saved["bank"] and "loc" not in _planted().modules()["bank"].state_dict()
    resumed = _planted(**kw)
    for k, m in resumed.modules().items():
        m.load_state_dict(saved[k])
    a, b = straight.step(ALL, 1, 0, "otc_match"), resumed.step(ALL, 1, 0, "otc_match")
    assert torch.equal(a.assignment.index, b.assignment.index) and (a.assignment.index >= 16).any()
    assert float(b.loss) == float(a.loss)


def test_own_negatives_keep_is_the_plain_loss():
    tr = _planted()
    scale = float(tr.model.scale().detach())
    out = tr.step(ALL, 0, 0, "otc_match")
    u, w = _features(tr)
    assert float(out.loss) == pytest.approx(_oracle(u, w, scale), abs=1e-5)


# ---------------------------------------------------------------------------------- reassigned_weight
@pytest.mark.parametrize("weight", [0.0, 0.25])
def test_reassigned_weight_scales_only_the_reassigned_pairs(weight):
    tr = _planted(reassigned_weight=weight)
    scale = float(tr.model.scale().detach())
    out = tr.step(ALL, 0, 0, "otc_match")
    u, w = _features(tr)
    moved = out.assignment.index != torch.arange(16)
    assert torch.equal(moved, POISON)  # planted: exactly the poisons are re-assigned
    expected = _oracle(u, w, scale, weight=torch.where(moved, weight, 1.0))
    assert abs(expected - _oracle(u, w, scale)) > 0.05
    assert abs(expected - _oracle(u, w, scale, weight=torch.where(moved, 1.0, weight))) > 0.05
    assert float(out.loss) == pytest.approx(expected, abs=1e-5)


def test_weighted_ot_alignment_is_the_weighted_mean_of_the_distances():
    g = torch.Generator().manual_seed(1)
    x = F.normalize(torch.randn(5, 4, 6, generator=g), dim=-1)
    y = F.normalize(torch.randn(5, 3, 6, generator=g), dim=-1)
    x2 = F.normalize(torch.randn(2, 4, 6, generator=g), dim=-1)
    cfg = OTConfig(loss_tol=None, n_iters=50)
    w = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.25])
    dist = torch.stack([ot_alignment(x[i : i + 1], y[i : i + 1], None, None, cfg) for i in range(5)])
    assert float(ot_alignment(x, y, None, None, cfg, weight=w)) == pytest.approx(
        float((dist * w).mean()), abs=1e-6
    )
    a, b = ot_alignments([(x, y, None, None), (x2, x2, None, None)], cfg, weights=[w, None])
    assert float(a) == pytest.approx(float((dist * w).mean()), abs=1e-5)
    assert float(b) == pytest.approx(float(ot_alignment(x2, x2, None, None, cfg)), abs=1e-6)


# ---------------------------------------------------------------------------------- match_schedule
def test_epoch_start_matching_is_computed_once_and_held_for_the_epoch():
    tr = _planted(match_schedule="epoch_start")
    stats = tr.impl.start_epoch(tr, 0, "otc_match")
    fixed = tr.impl._fixed["index"].clone()
    assert torch.equal(fixed[~POISON], torch.arange(12))  # clean pairs keep their own caption
    assert (image_class(tr.data)[fixed[POISON]] == 0).all() and not tr.poison[fixed].any()
    assert stats["epoch_start_own_kept"] == pytest.approx(0.75)
    # the model changes after the epoch start (every image now looks like a hat): the step must still train on
    # the epoch-start assignment, not re-match with the current model
    real = tr.model.encode_image
    tr.model.encode_image = lambda x: real(torch.full_like(x, (40 + 150) / 127.5 - 1))
    scale = float(tr.model.scale().detach())
    out = tr.step(ALL, 0, 0, "otc_match")
    assert torch.equal(out.assignment.index, fixed)
    hat = F.one_hot(torch.full((16,), 3), DIM).float()
    w = F.one_hot(tr.data.sig[fixed], DIM).float()
    assert float(out.loss) == pytest.approx(_oracle(hat, w, scale), abs=1e-5)
    assert tr.impl.start_epoch(tr, 1, "otc") == {} and tr.impl._fixed is None


# ---------------------------------------------------------------------------------- feature_layer
def _tiny(feature_layer: int) -> TinyCLIP:
    cfg = ModelConfig(width=32, layers=3, heads=2, text_width=32, text_layers=3, text_heads=2, embed_dim=16)
    torch.manual_seed(0)
    return TinyCLIP(ModelConfig(**{**cfg.__dict__, "feature_layer": feature_layer}), vocab_size=30)


def test_feature_layer_default_is_the_last_block_and_an_earlier_block_matches_a_manual_forward():
    g = torch.Generator().manual_seed(0)
    images = torch.rand(3, 1, 56, 56, generator=g) * 2 - 1
    ids = torch.randint(1, 30, (3, 7), generator=g)
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[0, 5:] = False
    base, last, early = _tiny(-1), _tiny(2), _tiny(-2)
    assert ModelConfig().feature_layer == -1
    i0, t0 = base.encode_image(images), base.encode_text(ids, mask)
    # two code paths (the encoder's own forward vs its blocks in turn, the projection of the whole sequence vs of
    # its patch rows): the same math, but float32 kernels may block the sums differently by shape and ISA (they
    # differed under AVX2 kernels on an AVX-512 machine), so 1e-6 rather than bitwise; the early-block check
    # below differs by > 1e-2
    close = dict(atol=1e-6, rtol=0)
    for m in (last, early):
        assert torch.allclose(m.encode_image(images).global_, i0.global_, **close)
        assert torch.allclose(m.encode_text(ids, mask).global_, t0.global_, **close)
    assert torch.allclose(last.encode_image(images).patches, i0.patches, **close)
    assert torch.allclose(last.encode_text(ids, mask).tokens, t0.tokens, **close)
    # manual forward through blocks 0 and 1 (of 3), then the same final LayerNorm and projection
    with torch.no_grad():
        x = base.patch_embed(images).flatten(2).transpose(1, 2)
        x = torch.cat([base.cls.expand(3, -1, -1), x], dim=1) + base.image_pos
        for blk in base.image_blocks.layers[:2]:
            x = blk(x)
        patches = F.normalize(base.image_proj(base.image_ln(x[:, 1:])), dim=-1)
        h = base.token_embed(ids) + base.text_pos[:, :7]
        for blk in base.text_blocks.layers[:2]:
            h = blk(h, src_key_padding_mask=~mask)
        tokens = F.normalize(base.text_proj(base.text_ln(h)), dim=-1) * mask[..., None]
        e_img, e_txt = early.encode_image(images), early.encode_text(ids, mask)
    assert torch.allclose(e_img.patches, patches, atol=1e-6)
    assert torch.allclose(e_txt.tokens, tokens, atol=1e-6)
    assert (e_img.patches - i0.patches).abs().max() > 1e-2
    assert (e_txt.tokens - t0.tokens).abs().max() > 1e-2
    assert torch.equal(e_txt.tokens[0, 5:], torch.zeros(2, 16))  # padding stays zero
    with pytest.raises(ValueError):
        _tiny(3).encode_image(images)


def test_feature_layer_is_checked_for_other_architectures():
    from reprlab.errors import ConfigError
    from reprlab.methods.otcclip.models.build import build_model

    with pytest.raises(ConfigError):
        build_model(ModelConfig(arch="hf_clip", feature_layer=-2), vocab_size=30)
    assert math.isfinite(float(build_model(ModelConfig(feature_layer=-2), 30).scale().detach()))


def test_options_that_need_the_whole_training_set_refuse_a_stream_and_bad_combinations():
    """``epoch_start`` and ``mask_text`` re-read every training pair: a streamed run stops at preflight, and a
    StreamTrainer (which holds one window, and has ``data``/``ids`` too) is refused by the defense itself; an
    ``epoch_start`` with a ``matched_text`` other than ``pool`` is refused when the defense is built."""
    from types import SimpleNamespace

    from reprlab.errors import ConfigError
    from reprlab.methods.otcclip import recipe
    from reprlab.methods.otcclip.defenses import DefenseConfig, make_defense
    from reprlab.methods.otcclip.training.stream import StreamTrainer

    from .test_recipe import _cfg

    for opt in (
        "defense.match_schedule=epoch_start",
        "defense.own_negatives=mask_text",
        "defense.own_negatives=mask_own",  # pair indices of a window mean nothing in the next
        "defense.reassigned_weight=0.5",
        "defense.flag=consensus",  # scores every training pair
    ):
        with pytest.raises(ConfigError, match="in-memory trainer only"):
            recipe.preflight(_cfg(["stream.write_shards=true", "data.clean_finetune_pairs=0", opt]))
        recipe.preflight(_cfg([opt]))  # in memory: fine
    assert Trainer.in_memory and not StreamTrainer.in_memory
    d = make_defense("otcclip", DefenseConfig(match_schedule="epoch_start"))
    with pytest.raises(ConfigError, match="needs the in-memory trainer"):
        d.start_epoch(SimpleNamespace(in_memory=False), 2, "otc_match")
    for cfg in (
        DefenseConfig(own_negatives="mask_own"),
        DefenseConfig(reassigned_weight=0.5),
        DefenseConfig(flag="consensus"),
    ):
        with pytest.raises(ConfigError, match="needs the in-memory trainer"):
            make_defense("otcclip", cfg).start_epoch(SimpleNamespace(in_memory=False), 0, "otc")
    with pytest.raises(ConfigError, match="matched_text=pool only"):
        make_defense("otcclip", DefenseConfig(match_schedule="epoch_start", matched_text="kept_grad"))
    with pytest.raises(ConfigError, match="flag_until"):
        make_defense("otcclip", DefenseConfig(flag="consensus", flag_start=5, flag_until=4))


def test_the_bank_records_caption_provenance_whenever_an_option_compares_it():
    """``own_negatives`` and ``reassigned_weight`` both compare the training pair a bank caption came from with
    the image's own; without the record every bank pick counts as another pair's caption (so with
    ``reassigned_weight`` alone a bank copy of the own caption was down-weighted as re-assigned)."""
    assert not hasattr(_planted().bank, "loc")  # default: checkpoints keep their keys
    for opts in ({"own_negatives": "mask_own"}, {"reassigned_weight": 0.5}):
        tr = _planted(**opts)
        tr.step(ALL, 0, 0, "otc")  # a non-matching step enqueues the batch with its pairs
        assert torch.equal(tr.bank.loc[:16], torch.arange(16)), opts


def test_whole_set_rematching_of_chosen_rows_over_a_chosen_pool():
    """``rows``/``pool`` (the flag probe's use): the planted poisons, offered only the clean captions, get a clean
    caption of their image's class, the captions the whole-set matching gives them; the index stays an index into
    all captions."""
    from reprlab.methods.otcclip.defenses.matching import rematch_whole_set

    tr = _planted(match_schedule="epoch_start")
    cfg = tr.impl.cfg
    whole = rematch_whole_set(tr.model, tr.data.images, tr.ids, tr.mask, cfg, tr.device)["index"]
    # the pool in reverse, so an index into it is not an index into the captions
    rows, pool = torch.nonzero(POISON).flatten(), torch.nonzero(~POISON).flatten().flip(0)
    got = rematch_whole_set(tr.model, tr.data.images, tr.ids, tr.mask, cfg, tr.device, rows=rows, pool=pool)
    assert len(got["index"]) == len(rows) == len(got["err"])
    assert set(got["index"].tolist()) <= set(pool.tolist())
    assert (image_class(tr.data)[got["index"]] == image_class(tr.data)[rows]).all()
    # the same caption content (captions of one class are identical here, so which copy wins a tie is the pool's
    # order); the planted features decide each match by a wide margin, whichever rows share an image batch
    assert torch.equal(tr.data.sig[got["index"]], tr.data.sig[whole[rows]])
