"""Each defense does its job on a planted problem with a known answer (``planted.py``).

Checked by breaking each defense on purpose (then restoring it):

* OTCCLIP training on its own caption instead of the matched one -> ``..._trains_on_the_matched_caption``;
  both OT loss weights forced to 0 -> both ``test_ot_losses_change_the_step...`` cases.
* SafeCLIP's safe/risky swapped in the split -> ``..._split_puts_planted_mismatches_in_the_risky_set``;
  swapped in the step -> ``..._step_trains_clip_on_safe_and_unimodal_on_risky_pairs``.
* RoCLIP enqueueing the batch before querying the bank -> both RoCLIP tests.
"""

import math

import pytest
import torch

from reprlab.methods.otcclip.config import DefenseConfig, OTConfig
from reprlab.methods.otcclip.data.tokenizer import WordTokenizer
from reprlab.methods.otcclip.defenses import REGISTRY, Defense
from reprlab.methods.otcclip.models.tiny import TinyCLIP
from reprlab.methods.otcclip.training.trainer import Trainer

from .planted import DIM, TRAIN, PlantedCLIP, image_class, planted_pairs, symmetric_infonce

POISON = torch.arange(16) >= 12
ALL = torch.arange(16)


def _planted(defense: str, **dcfg) -> Trainer:
    pairs = planted_pairs()
    tok = WordTokenizer.from_texts(pairs.captions)
    base = dict(
        bank_size=64,
        top_k=4,
        rematch_warmup=0,
        rematch_every=1,
        lambda_inter=0.0,
        lambda_intra=0.0,
        ot=OTConfig(eps=0.05, n_iters=50),
    )
    return Trainer(PlantedCLIP(tok), pairs, tok, defense, TRAIN, DefenseConfig(**{**base, **dcfg}), seed=0)


# ---------------------------------------------------------------------------------------------- OTCCLIP
@pytest.mark.parametrize("lambdas", [(0.0, 0.0), (0.1, 0.1)])
def test_otcclip_rematching_moves_planted_poisons_and_keeps_clean_captions(lambdas):
    tr = _planted("otcclip", lambda_inter=lambdas[0], lambda_intra=lambdas[1], keep_margin=0.05)
    out = tr.step(ALL, 0, 0, tr.phase(0))
    assert tr.phase(0) == "otc_match" and out.assignment is not None
    truth = image_class(tr.data)
    # every image ends on a caption of its true content: poisons (cat images with dog captions) move to a
    # clean cat caption (S = 0.5 vs their own -0.5), clean pairs keep a caption of their own content
    assert torch.equal(out.assignment.sig.cpu()[out.batch_loc], truth[out.batch_loc])
    assert not out.assignment.poison.any()
    # clean images keep exactly their own caption (ties go to the own caption)
    assert torch.equal(out.assignment.index[~POISON], torch.arange(12))
    stats = tr.run_epoch(1)
    assert stats["rematch_poison_moved"] == 1.0 and stats["rematch_clean_kept"] == 1.0
    assert stats["n_poison_seen"] == 4 and stats["n_clean_seen"] == 12


def test_otcclip_trains_on_the_matched_caption():
    """With both OT weights 0 the step's loss is the CLIP loss of (image, matched caption) pairs."""
    tr = _planted("otcclip")
    scale = float(tr.model.scale().detach())
    out = tr.step(ALL, 0, 0, "otc_match")
    u = torch.nn.functional.one_hot(image_class(tr.data), DIM).float()
    w_own = torch.nn.functional.one_hot(tr.data.sig, DIM).float()
    expected, own = symmetric_infonce(u, u, scale), symmetric_infonce(u, w_own, scale)
    assert abs(own - expected) > 0.1  # the planted poisons make the two hypotheses distinguishable
    assert out.loss == pytest.approx(expected, abs=1e-5)  # float32 loss vs float64 oracle


def test_otcclip_drop_mode_trains_clip_only_on_pairs_that_keep_their_caption():
    """matched_text='drop': the re-assigned (poisoned) rows leave the CLIP loss; kept rows train as usual."""
    tr = _planted("otcclip", matched_text="drop")
    scale = float(tr.model.scale().detach())
    out = tr.step(ALL, 0, 0, "otc_match")
    u = torch.nn.functional.one_hot(image_class(tr.data), DIM).float()
    w_own = torch.nn.functional.one_hot(tr.data.sig, DIM).float()
    kept = ~POISON  # planted: clean rows keep their own caption, the 4 poisons are re-assigned
    assert torch.equal(out.assignment.index[kept], torch.arange(12))
    assert not out.assignment.poison.any()
    expected, all_rows = symmetric_infonce(u[kept], w_own[kept], scale), symmetric_infonce(u, u, scale)
    assert abs(expected - all_rows) > 0.1  # dropping the rows is visible in the loss
    assert out.loss == pytest.approx(expected, abs=1e-5)


def test_otcclip_non_matching_epoch_trains_on_the_own_caption():
    tr = _planted("otcclip", rematch_warmup=1)
    scale = float(tr.model.scale().detach())
    out = tr.step(ALL, 0, 0, tr.phase(0))
    u = torch.nn.functional.one_hot(image_class(tr.data), DIM).float()
    w_own = torch.nn.functional.one_hot(tr.data.sig, DIM).float()
    assert tr.phase(0) == "otc" and out.assignment is None
    assert out.loss == pytest.approx(symmetric_infonce(u, w_own, scale), abs=1e-5)


class _Recording(torch.nn.Module):
    """Wraps TinyCLIP and keeps every patch/token feature tensor it returns, with its gradient."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.cfg, self.patches, self.tokens = inner, inner.cfg, [], []

    def scale(self):
        return self.inner.scale()

    @staticmethod
    def _keep(t, into):
        if t.requires_grad:
            t.retain_grad()
            into.append(t)

    def encode_image(self, x):
        f = self.inner.encode_image(x)
        self._keep(f.patches, self.patches)
        return f

    def encode_text(self, ids, mask):
        f = self.inner.encode_text(ids, mask)
        self._keep(f.tokens, self.tokens)
        return f


def _tiny(items, lambdas):
    from .test_trainer import CFG, _data

    data = _data(items, 16)
    tok = WordTokenizer.from_texts(data.captions)
    torch.manual_seed(0)
    model = _Recording(TinyCLIP(CFG, len(tok)))
    dcfg = DefenseConfig(
        bank_size=64,
        top_k=4,
        rematch_warmup=1,
        rematch_every=1,
        intra_subset=4,
        lambda_inter=lambdas[0],
        lambda_intra=lambdas[1],
        ot=OTConfig(n_iters=20),
    )
    return Trainer(
        model, data, tok, "otcclip", TRAIN.__class__(epochs=2, batch_size=8, warmup_steps=1), dcfg, 0
    )


@pytest.mark.parametrize("lambdas", [(1.0, 0.0), (0.0, 1.0)])
def test_ot_losses_change_the_step_and_reach_patch_and_token_features(items, lambdas):
    idx = torch.arange(8)
    base, ot = _tiny(items, (0.0, 0.0)), _tiny(items, lambdas)
    out0, out1 = base.step(idx, 0, 0, "otc"), ot.step(idx, 0, 0, "otc")
    name = "ot_inter" if lambdas[0] else "ot_intra"
    assert out1.terms[name] > 0.05 and "ot_inter" not in out0.terms and "ot_intra" not in out0.terms
    # the loss is CLIP + the weighted OT term (same CLIP term: same init, same batch)
    assert out1.terms["clip"] == pytest.approx(out0.terms["clip"], abs=1e-6)
    assert out1.loss == pytest.approx(out0.loss + out1.terms[name], abs=1e-5)

    # patch and token features are used only by the OT losses: they get gradient iff an OT loss is on
    def reached(ts):
        return any(t.grad is not None and t.grad.abs().sum() > 0 for t in ts)

    assert not reached(base.model.patches) and not reached(base.model.tokens)
    assert reached(ot.model.patches) and reached(ot.model.tokens)
    # ... and the parameter update differs from the CLIP-only step
    moved = sum(
        float((p - q).detach().abs().sum()) for p, q in zip(base.model.parameters(), ot.model.parameters())
    )
    assert moved > 1e-4


def _tiny_mode(items, lambdas, mode, **extra):
    tr = _tiny(items, lambdas)
    tr.dcfg = tr.impl.cfg = tr.impl.cfg.__class__(**{**tr.impl.cfg.__dict__, "matched_text": mode, **extra})
    return tr


def _text_grad(tr) -> float:
    grad = tr.model.inner.token_embed.weight.grad
    return 0.0 if grad is None else float(grad.abs().sum())


@pytest.mark.parametrize("lambdas", [(0.0, 0.0), (0.1, 0.1)])
def test_otcclip_kept_grad_trains_kept_own_captions_with_text_gradient(items, lambdas):
    """With a margin no caption can beat, every image keeps its own caption: a 'kept_grad' matching step is
    then the non-matching step (same loss, same update), while the default 'pool' step gives the text
    encoder no gradient at all (its captions are detached pool features)."""
    idx = torch.arange(8)
    plain = _tiny_mode(items, lambdas, "pool", keep_margin=10.0)
    kept = _tiny_mode(items, lambdas, "kept_grad", keep_margin=10.0)
    pool = _tiny_mode(items, lambdas, "pool", keep_margin=10.0)
    out_plain = plain.step(idx, 1, 0, "otc")
    out_kept = kept.step(idx, 1, 0, "otc_match")
    out_pool = pool.step(idx, 1, 0, "otc_match")
    assert torch.equal(out_kept.assignment.index, torch.arange(8))  # nothing re-assigned
    assert out_kept.loss == pytest.approx(out_plain.loss, abs=1e-5)
    assert out_pool.loss == pytest.approx(out_plain.loss, abs=1e-5)  # same values, different gradient
    assert _text_grad(plain) > 0 and _text_grad(kept) == pytest.approx(_text_grad(plain), rel=1e-4)
    if lambdas[1] == 0:  # without the intra term (own caption views) 'pool' leaves the text encoder alone
        assert _text_grad(pool) == 0.0
    assert _text_grad(pool) < 0.9 * _text_grad(kept)
    for p, q in zip(plain.model.parameters(), kept.model.parameters()):
        assert torch.allclose(p, q, atol=1e-6)


# ---------------------------------------------------------------------------------------------- RoCLIP
def test_roclip_queries_the_bank_before_the_batch_enters_it():
    tr = _planted("roclip", rematch_warmup=1)
    # plant one bank caption per class, slightly off its class direction (cos 0.98 with the class's images),
    # so the batch's own clean captions (cos 1) would win if they were already in the bank
    g = torch.nn.functional.normalize(torch.eye(DIM)[:4] + 0.2 * torch.eye(DIM)[DIM - 1], dim=-1)
    ids = torch.ones(4, 8, dtype=torch.long)
    tr.bank.enqueue(
        ids,
        ids > 0,
        g,
        g[:, None].expand(-1, 8, -1),
        torch.arange(100, 104),
        torch.zeros(4, dtype=torch.bool),
    )
    out = tr.step(ALL, 1, 0, tr.phase(1))
    assert tr.phase(1) == "roclip_match"
    assert torch.equal(out.assignment.sig.cpu(), 100 + image_class(tr.data))  # only pre-step bank entries
    assert len(tr.bank) == 4 + 16  # the batch entered the bank after the query


def test_roclip_trains_images_against_their_bank_neighbours():
    tr = _planted("roclip", rematch_warmup=1)
    g = torch.nn.functional.normalize(torch.eye(DIM)[:4] + 0.2 * torch.eye(DIM)[DIM - 1], dim=-1)
    ids = torch.ones(4, 8, dtype=torch.long)
    tr.bank.enqueue(
        ids,
        ids > 0,
        g,
        g[:, None].expand(-1, 8, -1),
        torch.arange(100, 104),
        torch.zeros(4, dtype=torch.bool),
    )
    scale = float(tr.model.scale().detach())
    out = tr.step(ALL, 1, 0, "roclip_match")
    u = torch.nn.functional.one_hot(image_class(tr.data), DIM).float()
    assert out.loss == pytest.approx(symmetric_infonce(u, g[image_class(tr.data)], scale), abs=1e-5)


# ---------------------------------------------------------------------------------------------- SafeCLIP
def test_safeclip_split_puts_planted_mismatches_in_the_risky_set():
    tr = _planted("safeclip", safeclip_unimodal_epochs=0, safeclip_ratio_start=0.75, safeclip_ratio_step=0.0)
    assert [tr.phase(e) for e in range(3)] == ["clip_lowlr", "safe_split", "safe_split"]
    tr.run_epoch(0)
    for epoch in (1, 2):  # the first split (GMM, p(clean) >= 0.9) and a later one (top 75% by cosine)
        stats = tr.run_epoch(epoch)
        assert torch.equal(tr.state.safe.cpu(), ~POISON), epoch
        assert stats["poison_in_risky"] == 1.0 and stats["safe_share"] == 0.75


def test_safeclip_step_trains_clip_on_safe_and_unimodal_on_risky_pairs():
    tr = _planted("safeclip", safeclip_unimodal_epochs=0)
    tr.state.safe.copy_(~POISON)
    scale, tau = float(tr.model.scale().detach()), tr.dcfg.unimodal_temperature
    out = tr.step(ALL, 1, 0, "safe_split")
    u = torch.nn.functional.one_hot(image_class(tr.data), DIM).float()
    w = torch.nn.functional.one_hot(tr.data.sig, DIM).float()
    safe, risky = ~POISON, POISON

    def expected(s, r):
        uni = symmetric_infonce(u[r], u[r], 1 / tau) + symmetric_infonce(w[r], w[r], 1 / tau)
        return symmetric_infonce(u[s], w[s], scale) + uni

    assert abs(expected(safe, risky) - expected(risky, safe)) > 0.1  # a swap would be visible
    assert out.loss == pytest.approx(expected(safe, risky), abs=1e-4)  # float32 vs float64
    assert out.terms["unimodal"] == pytest.approx(2 * math.log(4), abs=1e-4)  # 4 identical risky rows


# ---------------------------------------------------------------------------------------------- interface
def test_a_new_defense_is_a_registered_class():
    assert {"none", "roclip", "safeclip", "otcclip"} <= set(REGISTRY)
    assert all(issubclass(c, Defense) and REGISTRY[c.name] is c for c in REGISTRY.values())
    tr = _planted("none")
    assert not tr.impl.uses_bank and tr.impl.match_phases == ()
    tr.step(ALL, 0, 0, "clip")
    assert len(tr.bank) == 0  # only bank-using defenses fill the bank


# ---------------------------------------------------------------------------------------------- CleanCLIP
def test_cleanclip_adds_its_inmodal_loss_after_plain_clip_pretraining():
    tr = _planted("cleanclip", cleanclip_start_epoch=1, cleanclip_inmodal_weight=0.5)
    assert [tr.phase(e) for e in range(3)] == ["clip", "cleanclip", "cleanclip"]
    scale = float(tr.model.scale().detach())
    out = tr.step(ALL, 1, 0, "cleanclip")
    u = torch.nn.functional.one_hot(image_class(tr.data), DIM).double()
    w = torch.nn.functional.one_hot(tr.data.sig, DIM).double()

    def rows_ce(z):  # CE over rows of scale * z z^T (views are identical without augmentation)
        logits = scale * z @ z.T
        return float(-(logits.diagonal() - torch.logsumexp(logits, 1)).mean())

    inmodal = 0.5 * (rows_ce(u) + rows_ce(w))
    assert out.terms["inmodal"] == pytest.approx(inmodal, abs=1e-5)
    assert out.loss == pytest.approx(symmetric_infonce(u, w, scale) + 0.5 * inmodal, abs=1e-5)


def test_otcclip_match_lr_scale_scales_the_step_size_of_matching_epochs_only():
    tr = _planted("otcclip", rematch_warmup=1, match_lr_scale=0.1)
    lrs = {}
    for epoch in (0, 1):  # a non-matching and a matching epoch, same schedule position
        tr.step(ALL, epoch, 0, tr.phase(epoch))
        lrs[tr.phase(epoch)] = tr.opt.param_groups[0]["lr"]
    base = _planted("otcclip", rematch_warmup=1)
    base.step(ALL, 1, 0, base.phase(1))
    assert lrs["otc_match"] == pytest.approx(0.1 * base.opt.param_groups[0]["lr"])
    assert lrs["otc"] > lrs["otc_match"]
