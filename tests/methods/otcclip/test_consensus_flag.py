"""The consensus flag [ours] (defenses/consensus.py and OTCCLIP's ``flag='consensus'``).

* the score equals the formula written out with Python loops (float64) on clustered features, in any chunking;
* on synthetic web-like features it ranks mismatched pairs first, including copies of one image that all carry
  the same wrong caption, and that needs the duplicate rule (with it off, the copies vouch for each other);
* inside OTCCLIP, flagged pairs leave the CLIP term (the loss equals the written-out loss of the other pairs) and
  train the in-modality loss, whose value on the planted problem is known (2 log 4); flags accumulate over the
  flagging epochs and are the top share of the score.

Checked by breaking each on purpose (then restoring it): the duplicate mask removed, the sign of the score flipped,
the kept mask not applied to the CLIP term, flags overwritten instead of accumulated.
"""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score

from reprlab.methods.otcclip.defenses.consensus import consensus_scores, flag_top
from reprlab.methods.otcclip.models.embed import embed_images, embed_texts

from .planted import DIM, image_class
from .test_defenses import _planted
from .test_defenses_feedback import _oracle


def _reference(img, txt, k, dup_cos):
    """-mean over the k nearest captions (excluding self and image near-duplicates) of image cosines, by loops."""
    img, txt = img.double(), txt.double()
    n, out = len(img), []
    for i in range(n):
        cand = [j for j in range(n) if j != i and float(img[i] @ img[j]) <= dup_cos]
        cand.sort(key=lambda j: -float(txt[i] @ txt[j]))
        nn = cand[:k]
        out.append(-sum(float(img[i] @ img[j]) for j in nn) / max(len(nn), 1))
    return torch.tensor(out, dtype=torch.float64)


def _web_like(seed=0, n_per=40, classes=5, dim=16, noise=0.5):
    """Clean pairs (image and caption near their class centroid, separate noise), 12 'backdoor' pairs (images of
    random classes, captions of class 0) and 10 copies of one class-1 image captioned as class 2.
    Returns img, txt (normalised) and kind (0 clean, 1 copies, 2 backdoor)."""
    g = torch.Generator().manual_seed(seed)
    ci, ct = torch.randn(classes, dim, generator=g), torch.randn(classes, dim, generator=g)
    y = torch.arange(classes).repeat_interleave(n_per)
    img = ci[y] + noise * torch.randn(len(y), dim, generator=g)
    txt = ct[y] + noise * torch.randn(len(y), dim, generator=g)
    yb = torch.randint(1, classes, (12,), generator=g)
    img_b = ci[yb] + noise * torch.randn(12, dim, generator=g)
    txt_b = ct[0] + noise * torch.randn(12, dim, generator=g)
    img_c = (ci[1] + noise * torch.randn(dim, generator=g)).expand(10, dim)
    # the attacker's captions share a template: closer to each other than to clean captions of their class
    txt_c = ct[2] + noise * torch.randn(dim, generator=g) + 0.2 * noise * torch.randn(10, dim, generator=g)
    img = F.normalize(torch.cat([img, img_b, img_c]), dim=-1)
    txt = F.normalize(torch.cat([txt, txt_b, txt_c]), dim=-1)
    kind = torch.cat([torch.zeros(len(y)), torch.full((12,), 2), torch.ones(10)]).long()
    return img, txt, kind


@pytest.mark.parametrize("chunk", [1024, 7])
def test_consensus_score_matches_the_written_out_formula(chunk):
    img, txt, _ = _web_like(seed=1, n_per=8)
    got = consensus_scores(img, txt, k=5, duplicate_cos=0.98, chunk=chunk)
    # float32 matmuls against a float64 loop: agreement within 1e-5 (sums of 5 products of unit vectors)
    assert torch.allclose(got.double(), _reference(img, txt, 5, 0.98), atol=1e-5)
    # side='image' is the same formula with the roles of the two feature sets swapped (duplicate rule off)
    swapped = consensus_scores(txt, img, k=5, duplicate_cos=2.0, side="image", chunk=chunk)
    assert torch.allclose(swapped.double(), _reference(img, txt, 5, 2.0), atol=1e-5)


def test_consensus_ranks_mismatched_pairs_first_and_copies_need_the_duplicate_rule():
    for seed in range(3):
        img, txt, kind = _web_like(seed)
        s = consensus_scores(img, txt, k=8)  # k below the 10 copies: without the rule they are each other's
        # whole neighbourhood
        for bad in (1, 2):
            m = (kind == 0) | (kind == bad)
            assert roc_auc_score((kind[m] == bad).numpy(), s[m].numpy()) > 0.95  # 0.96-1.00 over seeds 0-5
        flagged = flag_top(s, 0.15)
        assert flagged[kind > 0].sum() >= 19  # of 22 mismatched pairs among 222, in the top 15 % (19-22 seen)
        # copies of one image vouch for each other when the duplicate rule is off
        off = consensus_scores(img, txt, k=8, duplicate_cos=2.0)
        m = kind <= 1
        assert (
            roc_auc_score((kind[m] == 1).numpy(), off[m].numpy()) < 0.5
        )  # 0.0: the copies look the best supported


def test_flag_top_takes_the_rounded_share_and_breaks_ties_by_index():
    s = torch.tensor([0.5, 0.9, 0.5, 0.1, 0.5])
    assert flag_top(s, 0.4).tolist() == [True, True, False, False, False]
    assert flag_top(s, 0.2).tolist() == [False, True, False, False, False]
    with pytest.raises(ValueError, match=r"\(N, d\)"):
        consensus_scores(torch.zeros(3, 2), torch.zeros(4, 2))


def _flagged_trainer(**kw):
    # rematch_warmup 99: no matching epoch, so the step's captions are the own ones
    return _planted("otcclip", rematch_warmup=99, flag="consensus", **kw)


def test_flagged_pairs_leave_the_clip_term_and_train_in_modality():
    all_rows = torch.arange(16)
    for mode in ("drop", "inmodal"):
        tr = _flagged_trainer(flag_start=5, flag_until=5, flagged_train=mode)
        tr.state.safe[12:] = False  # flag the four planted poisons by hand
        scale = float(tr.model.scale().detach())
        out = tr.step(all_rows, 0, 0, "otc")
        u = F.one_hot(image_class(tr.data), DIM).float()
        w = F.one_hot(tr.data.sig, DIM).float()  # own captions (no matching epoch)
        clean = _oracle(u[:12], w[:12], scale)
        assert abs(clean - _oracle(u, w, scale)) > 0.05  # dropping the poisons is visible
        # in-modality InfoNCE over the 4 flagged rows: all views identical, so each direction is log 4
        expected = clean + (2 * math.log(4) if mode == "inmodal" else 0.0)
        assert float(out.loss) == pytest.approx(expected, abs=1e-5)


def test_flags_are_the_top_share_of_the_score_and_accumulate_over_the_flagging_epochs():
    tr = _flagged_trainer(flag_start=0, flag_until=1, flag_share=0.25, flag_k=3, flag_duplicate_cos=2.0)
    stats = tr.impl.start_epoch(tr, 0, "otc")
    img, txt = embed_images(tr.model, tr.data.images), embed_texts(tr.model, tr.ids, tr.mask)
    first = flag_top(consensus_scores(img, txt, 3, 2.0), 0.25)
    assert torch.equal(~tr.state.safe.cpu(), first)
    assert stats["flagged_share"] == pytest.approx(0.25)
    tr.state.safe.copy_(~torch.arange(16).eq(0))  # pretend pair 0 was flagged earlier
    tr.impl.start_epoch(tr, 1, "otc")
    assert torch.equal(~tr.state.safe.cpu(), first | torch.arange(16).eq(0))  # union, not overwritten
    before = tr.state.safe.clone()
    tr.impl.start_epoch(tr, 2, "otc")  # after flag_until: unchanged
    assert torch.equal(tr.state.safe, before)
    assert np.isfinite(stats["poison_flagged"])


@pytest.mark.parametrize("cohort", [-1, 0])
def test_flags_are_checkpointed_so_a_resumed_run_trains_the_same_step(cohort):
    kw = dict(flag_start=0, flag_until=0, flag_share=0.25, flag_k=3, flag_duplicate_cos=2.0)
    kw.update(flag_cohort_start=cohort, flag_cohort_epochs=1)  # 0: the held cohort is in the checkpoint too
    straight = _flagged_trainer(**kw)
    straight.impl.start_epoch(straight, 0, "otc")
    saved = {k: {n: t.clone() for n, t in m.state_dict().items()} for k, m in straight.modules().items()}
    resumed = _flagged_trainer(**kw)
    for k, m in resumed.modules().items():
        m.load_state_dict(saved[k])
    resumed.impl.start_epoch(resumed, 1, "otc")  # past flag_until: the restored flags stand
    assert torch.equal(resumed.state.safe, straight.state.safe) and (~straight.state.safe).any()
    if cohort == 0:
        assert torch.equal(resumed.state.held, straight.state.held) and straight.state.held.any()
    a, b = straight.step(torch.arange(16), 1, 0, "otc"), resumed.step(torch.arange(16), 1, 0, "otc")
    assert float(b.loss) == float(a.loss)


def test_release_returns_flagged_pairs_that_score_like_the_accepted_ones():
    """Planted scores (k=2): clean pairs -1 or -0.5 (the dogs share their captions with the poisons), the poisons
    0. Two clean pairs and two poisons flagged by hand; the 0.75 quantile of the accepted pairs' scores is -0.5, so
    the two clean pairs (-1) come back and the poisons stay."""
    kw = dict(flag_start=9, flag_until=9, flag_k=2, flag_duplicate_cos=2.0, flag_release_epoch=1)
    tr = _flagged_trainer(flag_release_quantile=0.75, **kw)
    flagged = torch.zeros(16, dtype=torch.bool)
    flagged[[0, 6, 12, 13]] = True
    tr.state.safe.copy_(~flagged)
    tr.impl.start_epoch(tr, 0, "otc")  # before the release epoch: nothing changes
    assert torch.equal(tr.state.safe, ~flagged)
    img, txt = embed_images(tr.model, tr.data.images), embed_texts(tr.model, tr.ids, tr.mask)
    score = consensus_scores(img, txt, 2, 2.0)
    assert float(torch.quantile(score[~flagged], 0.75)) == pytest.approx(-0.5)
    stats = tr.impl.start_epoch(tr, 1, "otc")
    expected = torch.zeros(16, dtype=torch.bool)
    expected[[12, 13]] = True
    assert torch.equal(~tr.state.safe.cpu(), expected)
    assert stats["released"] == 2


def test_release_until_ends_the_release_after_its_epoch():
    """The same planted release with flag_release_until=1: epoch 1 releases the two clean pairs; re-flagging them
    by hand, epoch 2 releases nothing (without the key it releases them again); a window that cannot release is
    refused by name."""
    from reprlab.errors import ConfigError

    kw = dict(flag_start=9, flag_until=9, flag_k=2, flag_duplicate_cos=2.0, flag_release_epoch=1)
    flagged = torch.zeros(16, dtype=torch.bool)
    flagged[[0, 6, 12, 13]] = True
    for until, again in ((1, 0), (-1, 2)):
        tr = _flagged_trainer(flag_release_quantile=0.75, flag_release_until=until, **kw)
        tr.state.safe.copy_(~flagged)
        assert tr.impl.start_epoch(tr, 1, "otc")["released"] == 2
        tr.state.safe.copy_(~flagged)
        stats = tr.impl.start_epoch(tr, 2, "otc")
        assert stats.get("released", 0) == again
        assert torch.equal(
            ~tr.state.safe.cpu(), flagged if again == 0 else flagged & (torch.arange(16) >= 12)
        )
    for bad in (dict(flag_release_epoch=-1), dict(flag_release_epoch=3)):
        with pytest.raises(ConfigError, match="flag_release_until"):
            _flagged_trainer(**{**kw, **bad, "flag_release_until": 2})


def test_rematch_false_leaves_otcclip_without_matching_epochs_and_roclip_unchanged():
    from reprlab.methods.otcclip.defenses import DefenseConfig, make_defense

    on, off = DefenseConfig(rematch_warmup=2), DefenseConfig(rematch_warmup=2, rematch=False)
    assert [make_defense("otcclip", on).phase(e) for e in range(5)] == [
        "otc",
        "otc",
        *["otc_match", "otc"] * 1,
        "otc_match",
    ]
    assert {make_defense("otcclip", off).phase(e) for e in range(20)} == {"otc"}
    assert make_defense("roclip", off).phase(2) == make_defense("roclip", on).phase(2) == "roclip_match"


def test_a_flag_spreads_to_near_duplicate_images_only():
    from reprlab.methods.otcclip.defenses.copies import spread_to_duplicates

    img, txt, kind = _web_like(seed=0)
    copies = torch.nonzero(kind == 1).flatten()
    one = torch.zeros(len(img), dtype=torch.bool)
    one[copies[0]] = True
    spread = spread_to_duplicates(img, one, 0.98, chunk=50)
    assert torch.equal(spread, kind == 1)  # every copy, nothing else (clean images are never that close)
    assert torch.equal(spread_to_duplicates(img, torch.zeros_like(one)), torch.zeros_like(one))
    tr = _flagged_trainer(flag_start=0, flag_until=0, flag_share=1 / 16, flag_k=2, flag_duplicate_cos=0.98)
    tr.impl.start_epoch(tr, 0, "otc")
    single = ~tr.state.safe.cpu()
    tr2 = _flagged_trainer(
        flag_start=0, flag_until=0, flag_share=1 / 16, flag_k=2, flag_duplicate_cos=0.98, flag_duplicates=True
    )
    tr2.impl.start_epoch(tr2, 0, "otc")
    # planted images of one class are identical: the flag covers the flagged image's whole class
    cls = image_class(tr.data)
    assert int(single.sum()) == 1
    assert torch.equal(~tr2.state.safe.cpu(), cls == cls[single][0])


def test_copies_are_released_together_when_asked():
    """Known answer: pairs 0-3 are copies of one image (one of them scores high), 4-5 two other images; 0-5 are
    flagged, 6-9 accepted with scores 0..0.3 (the 0.5 quantile is 0.15). One by one, the low-scoring copies 0-2 and
    pair 4 come back; together, the copy that stays (3) keeps 0-2 flagged, and 4 still comes back."""
    from reprlab.methods.otcclip.defenses.release import release_mask

    img = F.normalize(torch.eye(8)[[0, 0, 0, 0, 1, 2, 3, 4, 5, 6]], dim=-1)
    score = torch.tensor([-1.0, -1.0, -1.0, 0.9, -1.0, 0.5, 0.0, 0.1, 0.2, 0.3])
    safe = torch.tensor([False] * 6 + [True] * 4)
    alone = release_mask(score, safe, img, 0.5, together=False, duplicate_cos=0.999)
    assert alone.nonzero().flatten().tolist() == [0, 1, 2, 4]
    both = release_mask(score, safe, img, 0.5, together=True, duplicate_cos=0.999)
    assert both.nonzero().flatten().tolist() == [4]


def test_ranks_are_scaled_positions_with_ties_broken_by_index():
    from reprlab.methods.otcclip.defenses.consensus import ranks

    assert ranks(torch.tensor([0.3, 0.1, 0.3, 0.9])).tolist() == [0.25, 0.0, 0.5, 0.75]


def _coordinated(seed, n_per=40, classes=5, dim=16, nb=30):
    """Clean pairs (image and caption near their class centroid, noise 1) and ``nb`` poisons that vouch for each
    other and are learnt: captions of class 0 like the clean ones, images of random other classes that share one
    trigger direction and were pulled toward their own caption (0.9 x caption + 0.5 x trigger + the item's
    class). Returns unit img, txt and kind (0 clean, 1 poison)."""
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(classes, dim, generator=g)
    y = torch.arange(classes).repeat_interleave(n_per)
    img = c[y] + torch.randn(len(y), dim, generator=g)
    txt = c[y] + torch.randn(len(y), dim, generator=g)
    trigger = torch.randn(dim, generator=g)
    yb = torch.randint(1, classes, (nb,), generator=g)
    txt_b = c[0] + torch.randn(nb, dim, generator=g)
    img_b = c[yb] + 0.5 * trigger + 0.9 * txt_b + 0.2 * torch.randn(nb, dim, generator=g)
    kind = torch.cat([torch.zeros(len(y)), torch.ones(nb)]).long()
    return F.normalize(torch.cat([img, img_b]), dim=-1), F.normalize(torch.cat([txt, txt_b]), dim=-1), kind


def test_fit_finds_the_mismatches_that_vouch_for_each_other():
    """A group of learnt poisons half-hides from the consensus score (AUROC 0.38-0.77 over seeds 0-5: about a
    third of a poison caption's neighbours are other poisons); adding the rank of how well each pair fits its own
    caption lifts every seed (0.77-0.95 seen)."""
    from reprlab.methods.otcclip.defenses.consensus import memorised_mismatch_scores, ranks

    gains, combined = [], []
    for seed in range(6):
        img, txt, kind = _coordinated(seed)
        cons = consensus_scores(img, txt, k=8)
        both = memorised_mismatch_scores(cons, img, txt)
        assert torch.allclose(both, ranks(cons) + ranks((img * txt).sum(1)))
        a_cons = roc_auc_score(kind.numpy(), cons.numpy())
        combined.append(roc_auc_score(kind.numpy(), both.numpy()))
        gains.append(combined[-1] - a_cons)
    assert min(gains) > 0.1  # 0.17-0.39 seen
    assert np.mean(combined) > 0.85  # 0.88 seen


def test_consensus_fit_flags_the_top_share_of_the_combined_score():
    from reprlab.methods.otcclip.defenses.consensus import memorised_mismatch_scores

    kw = dict(flag_start=0, flag_until=0, flag_share=0.25, flag_k=3, flag_duplicate_cos=2.0)
    tr = _planted("otcclip", rematch_warmup=99, flag="consensus_fit", **kw)
    tr.impl.start_epoch(tr, 0, "otc")
    img, txt = embed_images(tr.model, tr.data.images), embed_texts(tr.model, tr.ids, tr.mask)
    expected = flag_top(memorised_mismatch_scores(consensus_scores(img, txt, 3, 2.0), img, txt), 0.25)
    assert torch.equal(~tr.state.safe.cpu(), expected)


def test_inmodal_all_trains_every_pair_in_modality_from_the_flag_start():
    """Known answer: with the oracle's one-hot features, an in-modality InfoNCE over all 16 rows at scale S = 1 /
    temperature gives row i the loss -log(e^S / (n e^S + 16 - n)), n the rows of its class (7 cats and 3 of each
    other class among the images, 7 dogs and 3 of each other among the captions); before flag_start no such term."""
    all_rows = torch.arange(16)
    tr = _flagged_trainer(flag_start=1, flag_until=5, flagged_train="inmodal_all")
    tr.state.safe[12:] = False
    scale = float(tr.model.scale().detach())
    u = F.one_hot(image_class(tr.data), DIM).float()
    w = F.one_hot(tr.data.sig, DIM).float()
    clean = _oracle(u[:12], w[:12], scale)
    before = tr.step(all_rows, 0, 0, "otc")
    assert "inmodal" not in before.terms and float(before.loss) == pytest.approx(clean, abs=1e-5)
    s = 1.0 / tr.dcfg.unimodal_temperature
    n = torch.tensor([7.0] * 7 + [3.0] * 9)
    per_row = -(s - torch.log(n * math.exp(s) + 16 - n))
    out = tr.step(all_rows, 1, 0, "otc")
    assert float(out.loss) == pytest.approx(clean + 2 * float(per_row.mean()), abs=1e-4)


def _reference_voters(img, txt, k, voters):
    """As :func:`_reference` (duplicate rule off), with only ``voters`` as candidate neighbours."""
    img, txt = img.double(), txt.double()
    out = []
    for i in range(len(img)):
        cand = sorted(
            (j for j in range(len(img)) if j != i and voters[j]), key=lambda j: -float(txt[i] @ txt[j])
        )
        nn = cand[:k]
        out.append(-sum(float(img[i] @ img[j]) for j in nn) / max(len(nn), 1))
    return torch.tensor(out, dtype=torch.float64)


def test_voters_leave_flagged_pairs_out_of_every_neighbourhood():
    """The written-out formula with a voter mask; and on learnt poisons that vouch for each other, once half of
    them are flagged (no longer voters), the other half score as less supported than with every pair voting."""
    img, txt, _ = _web_like(seed=2, n_per=8)
    voters = torch.rand(len(img), generator=torch.Generator().manual_seed(0)) > 0.3
    got = consensus_scores(img, txt, k=5, duplicate_cos=2.0, chunk=7, voters=voters)
    assert torch.allclose(got.double(), _reference_voters(img, txt, 5, voters), atol=1e-5)  # float32 vs loops
    gains = []
    for seed in range(6):
        img, txt, kind = _coordinated(seed)
        voters = torch.ones(len(kind), dtype=torch.bool)
        voters[torch.nonzero(kind == 1).flatten()[::2]] = (
            False  # half the poisons flagged at an earlier epoch
        )
        y = kind[voters].numpy()
        every = roc_auc_score(y, consensus_scores(img, txt, k=8)[voters].numpy())
        gains.append(roc_auc_score(y, consensus_scores(img, txt, k=8, voters=voters)[voters].numpy()) - every)
    assert min(gains) > 0.02  # 0.036-0.099 seen over seeds 0-5


def test_flag_vouch_unflagged_scores_with_the_accepted_pairs_only():
    kw = dict(flag_start=0, flag_until=0, flag_share=0.25, flag_k=3, flag_duplicate_cos=2.0)
    for vouch in ("all", "unflagged"):
        tr = _flagged_trainer(flag_vouch=vouch, **kw)
        tr.state.safe[12:14] = False  # flagged before this epoch
        voters = tr.state.safe.cpu().clone()
        tr.impl.start_epoch(tr, 0, "otc")
        img, txt = embed_images(tr.model, tr.data.images), embed_texts(tr.model, tr.ids, tr.mask)
        score = consensus_scores(img, txt, 3, 2.0, voters=voters if vouch == "unflagged" else None)
        assert torch.equal(~tr.state.safe.cpu(), flag_top(score, 0.25) | ~voters)


def test_flagged_unlearn_pushes_flagged_images_down_to_the_bound_and_no_further():
    """Known answer on hand-made unit features (one process: the gathers are the identity): the term is the
    mean over flagged rows of relu(cos(u_i, w_i) - m_i); m_i = image i's mean cosine with the other captions
    ('random') or the median own-pair cosine of the unflagged rows ('accepted'). Gradient reaches only the flagged
    images above their bound; the captions get none."""
    from types import SimpleNamespace

    from reprlab.methods.otcclip.defenses.consensus import flagged_unlearn_loss

    g = torch.Generator().manual_seed(3)
    u0 = F.normalize(torch.randn(6, 4, generator=g), dim=-1)
    w0 = F.normalize(u0 + 0.8 * torch.randn(6, 4, generator=g), dim=-1)
    w0[3], w0[5] = u0[3], F.normalize(u0[5] + 0.1 * w0[5], dim=0)  # flagged pairs fit well: above both bounds
    w0[4] = -u0[4]  # a flagged pair already far below any bound: no loss, no gradient
    rows = torch.tensor([False, False, False, True, True, True])
    cos = (u0 @ w0.T).double()
    for margin in ("random", "accepted"):
        u, w = u0.clone().requires_grad_(), w0.clone().requires_grad_()
        img, own = SimpleNamespace(global_=u), SimpleNamespace(global_=w)
        got = flagged_unlearn_loss(None, None, img, own, rows, margin)
        per_row = []
        for i in (3, 4, 5):
            if margin == "random":
                bar = sum(float(cos[i, j]) for j in range(6) if j != i) / 5
            else:
                bar = float(np.median([float(cos[j, j]) for j in (0, 1, 2)]))
            per_row.append(max(float(cos[i, i]) - bar, 0.0))
        assert float(got.detach()) == pytest.approx(sum(per_row) / 3, abs=1e-6)
        assert per_row[1] == 0.0 and min(per_row[0], per_row[2]) > 0.05  # rows on each side of the bound
        got.backward()
        assert w.grad is None or not w.grad.any()  # captions detached
        moved = u.grad.abs().sum(1) > 0
        assert moved.tolist() == [False, False, False] + [r > 0 for r in per_row]


def test_trust_epoch_keeps_the_most_supported_share_and_releases_nothing_after():
    kw = dict(flag_start=0, flag_until=0, flag_share=0.25, flag_k=3, flag_duplicate_cos=2.0)
    tr = _flagged_trainer(trust_epoch=1, trust_share=0.5, flag_release_epoch=1, **kw)
    tr.impl.start_epoch(tr, 0, "otc")
    before = tr.state.safe.cpu().clone()
    tr.impl.start_epoch(tr, 1, "otc")
    img, txt = embed_images(tr.model, tr.data.images), embed_texts(tr.model, tr.ids, tr.mask)
    score = consensus_scores(img, txt, 3, 2.0)
    kept = flag_top(-score.masked_fill(~before, float("inf")), 0.5)
    assert torch.equal(tr.state.safe.cpu(), before & kept) and int(kept.sum()) == 8
    after = tr.state.safe.clone()
    stats = tr.impl.start_epoch(tr, 2, "otc")  # a release epoch, but inside the trusted phase
    assert torch.equal(tr.state.safe, after) and "released" not in stats


def test_flag_diagnostics_split_targeted_and_backdoor_poisons():
    from reprlab.methods.otcclip.data.pairs import BACKDOOR

    tr = _flagged_trainer(flag_start=5, flag_until=5)
    tr.data.kind[14:] = BACKDOOR  # rows 12-13 stay targeted
    tr.state.safe[[0, 12, 14, 15]] = False
    stats = tr.impl.start_epoch(tr, 0, "otc")  # not a flagging epoch: the hand-made flags stand
    assert stats["targeted_flagged"] == 0.5 and stats["backdoor_flagged"] == 1.0
    assert stats["poison_flagged"] == 0.75 and stats["flagged_share"] == pytest.approx(4 / 16)


def _learned_trigger(seed, n_per=40, classes=5, dim=16, nb=30):
    """Clean pairs as in :func:`_coordinated` and ``nb`` poisons whose trigger the model has learned: images of
    random other classes drawn to the centre of class 0, whose captions they carry (3 x class 0 + 0.5 x the item
    + small noise). Returns unit img, txt and kind (0 clean, 1 poison)."""
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(classes, dim, generator=g)
    y = torch.arange(classes).repeat_interleave(n_per)
    img = c[y] + torch.randn(len(y), dim, generator=g)
    txt = c[y] + torch.randn(len(y), dim, generator=g)
    yb = torch.randint(1, classes, (nb,), generator=g)
    txt_b = c[0] + torch.randn(nb, dim, generator=g)
    img_b = 3.0 * c[0] + 0.5 * c[yb] + 0.3 * torch.randn(nb, dim, generator=g)
    kind = torch.cat([torch.zeros(len(y)), torch.ones(nb)]).long()
    return F.normalize(torch.cat([img, img_b]), dim=-1), F.normalize(torch.cat([txt, txt_b]), dim=-1), kind


def test_a_learned_trigger_is_a_cohort_the_consensus_score_ranks_last():
    """Poisons of a learned trigger look better supported than clean pairs (consensus AUROC 0.02-0.23 over seeds
    0-5: inverted), and the cohort score (support rank + fit rank) ranks them first (0.73-0.95 seen)."""
    from reprlab.methods.otcclip.defenses.consensus import cohort_scores, ranks

    cons_auc, cohort_auc = [], []
    for seed in range(6):
        img, txt, kind = _learned_trigger(seed)
        cons = consensus_scores(img, txt, k=8)
        score = cohort_scores(cons, img, txt)
        assert torch.allclose(score, ranks(-cons) + ranks((img * txt).sum(1)))
        cons_auc.append(roc_auc_score(kind.numpy(), cons.numpy()))
        cohort_auc.append(roc_auc_score(kind.numpy(), score.numpy()))
    assert max(cons_auc) < 0.35 and min(cohort_auc) > 0.65 and np.mean(cohort_auc) > 0.8  # 0.86 seen


def test_flag_cohort_flags_the_top_share_after_the_release():
    """A cohort member stays flagged even where the release alone would return it, for the rest of training;
    other releases go on."""
    from reprlab.methods.otcclip.defenses.consensus import cohort_scores
    from reprlab.methods.otcclip.defenses.release import release_mask

    kw = dict(flag_start=5, flag_until=5, flag_k=3, flag_duplicate_cos=2.0, flag_release_epoch=0)
    tr = _flagged_trainer(flag_cohort_start=0, flag_cohort_share=0.25, **kw)
    img, txt = embed_images(tr.model, tr.data.images), embed_texts(tr.model, tr.ids, tr.mask)
    cons = consensus_scores(img, txt, 3, 2.0)
    top = flag_top(cohort_scores(cons, img, txt), 0.25)
    tr.state.safe[top.to(tr.state.safe.device)] = False  # flagged earlier, by hand, with two more pairs
    tr.state.safe[[i for i in range(16) if not top[i]][:2]] = False
    before = tr.state.safe.cpu().clone()
    back = release_mask(cons, before, img, tr.dcfg.flag_release_quantile, False, 2.0)
    assert (back & top).any() and (back & ~top).any()  # the release alone would return a cohort member
    stats = tr.impl.start_epoch(tr, 0, "otc")
    assert torch.equal(tr.state.safe.cpu(), (before | back) & ~top)
    assert stats["cohort_flagged"] == 4 and stats["released"] == int(back.sum())
    later = tr.impl.start_epoch(tr, 3, "otc")  # past the cohort's three epochs: only the release acts
    assert "cohort_flagged" not in later and torch.equal(tr.state.held.cpu(), top)
    assert not tr.state.safe.cpu()[top].any()  # held: the release would return them (above), and does not


@pytest.mark.parametrize("rows", ["flagged", "held"])
def test_flagged_unlearn_in_the_step_reads_the_chosen_rows(rows):
    """Known answer on the planted problem (one-hot features): the step's ``unlearn`` term is the mean over the
    chosen rows of relu(1[class_i = sig_i] - mean_{j != i} 1[class_i = sig_j]) (the 'random' bound)."""
    tr = _flagged_trainer(flag_start=5, flag_until=5, flag_cohort_start=9, flagged_unlearn=1.0,
                          flagged_unlearn_rows=rows)  # fmt: skip
    tr.state.safe[[0, 1, 12, 13, 14, 15]] = False
    tr.state.held[[0, 1]] = True  # two clean pairs held by hand; the four poisons are flagged only
    out = tr.step(torch.arange(16), 0, 0, "otc")
    u = F.one_hot(image_class(tr.data), DIM).float()
    w = F.one_hot(tr.data.sig, DIM).float()
    cos = u @ w.T
    chosen = [0, 1] if rows == "held" else [0, 1, 12, 13, 14, 15]
    want = [max(float(cos[i, i]) - (float(cos[i].sum()) - float(cos[i, i])) / 15, 0.0) for i in chosen]
    assert out.terms["unlearn"] == pytest.approx(sum(want) / len(want), abs=1e-5)
    assert (
        sum(want) / len(want) > 0.25
    )  # 0.867 held, 0.289 flagged (the poisons' own captions are not theirs)


def test_flag_options_without_what_they_act_through_are_refused_by_name():
    from reprlab.errors import ConfigError
    from reprlab.methods.otcclip.config import DefenseConfig
    from reprlab.methods.otcclip.defenses import make_defense

    for key, value in (("flag_vouch", "unflagged"), ("flag_cohort_start", 7), ("trust_epoch", 10),
                       ("flagged_unlearn", 1.0)):  # fmt: skip
        with pytest.raises(ConfigError, match=rf"defense\.{key} act only with a flag"):
            make_defense("otcclip", DefenseConfig(**{key: value}))
        make_defense("otcclip", DefenseConfig(flag="consensus", **{key: value}))  # with a flag: accepted
    with pytest.raises(ConfigError, match="flagged_unlearn_rows=held needs a held cohort"):
        make_defense(
            "otcclip", DefenseConfig(flag="consensus", flagged_unlearn=1.0, flagged_unlearn_rows="held")
        )
    make_defense("otcclip", DefenseConfig(flagged_train="inmodal_all"))  # inert without a flag, as documented


def test_preflight_refuses_otcclip_options_before_any_defense_trains():
    """With all five defenses OTCCLIP trains fourth: its option checks run at preflight, so a bad setting stops
    ``reprlab run`` before a run folder exists (tests/test_errors_cli.py); a defense the run does not train is not
    checked."""
    from reprlab.errors import ConfigError
    from reprlab.methods.otcclip import recipe

    from .test_recipe import _cfg

    five = "defenses=[none,roclip,safeclip,otcclip,cleanclip]"
    bad = (
        (["defense.flagged_unlearn=1.0"], r"defense\.flagged_unlearn act only with a flag"),
        (["defense.flag=consensus", "defense.flag_release_veto=0.3"], "flag_release_veto acts on a release"),
        (["defense.match_schedule=epoch_start", "defense.matched_text=drop"], "epoch_start supports"),
    )
    for opts, message in bad:
        with pytest.raises(ConfigError, match=message):
            recipe.preflight(_cfg([five, *opts]))
        recipe.preflight(_cfg(["defenses=[none,roclip]", *opts]))  # OTCCLIP not trained: not its business


@pytest.mark.parametrize("chunk", [1, 7, 1024])
def test_neighbourhood_share_matches_the_written_out_count(chunk):
    """Share of each row's k nearest images in the group, copies of its own image left out, by loops (float64)."""
    from reprlab.methods.otcclip.defenses.consensus import neighbourhood_share, neighbourhood_shares

    img, _, kind = _web_like(seed=3)  # ten copies of one image (kind 1): each other's duplicates
    group = kind > 0
    got = neighbourhood_share(img, group, k=6, duplicate_cos=0.999, chunk=chunk)
    x = img.double()
    for i in range(len(x)):
        cand = [j for j in range(len(x)) if j != i and float(x[i] @ x[j]) <= 0.999]
        cand.sort(key=lambda j: -float(x[i] @ x[j]))
        want = sum(bool(group[j]) for j in cand[:6]) / 6
        assert float(got[i]) == pytest.approx(want, abs=1e-6), i
    assert float(got[kind == 1].max()) < 1.0  # the copies do not count each other
    # several groups from one search (update_flags' purity and growth) equal one search per group: the same path
    other = kind == 2
    both = neighbourhood_shares(img, [group, other], k=6, duplicate_cos=0.999, chunk=chunk)
    assert torch.equal(both[0], got)
    assert torch.equal(both[1], neighbourhood_share(img, other, k=6, duplicate_cos=0.999, chunk=chunk))


def _trigger_cluster(seed):
    """Five concepts of 40 images (rows 0-199) and 30 triggered images of any concept (rows 200-229) that share
    one trigger direction, which dominates their features (a learned trigger). Returns the unit rows, the clean
    rows before normalising, the concept centres and the clean rows' concepts."""
    g = torch.Generator().manual_seed(seed)
    c, trig = torch.randn(5, 16, generator=g), torch.randn(16, generator=g)
    y = torch.arange(5).repeat_interleave(40)
    clean = c[y] + 0.7 * torch.randn(200, 16, generator=g)
    poison = (
        2.0 * trig + 0.5 * c[torch.randint(0, 5, (30,), generator=g)] + 0.3 * torch.randn(30, 16, generator=g)
    )
    return F.normalize(torch.cat([clean, poison]), dim=-1), clean, c, y


def test_cohort_purity_keeps_a_learned_trigger_and_drops_a_clean_concepts_best_pairs():
    """Five concepts of 40 images and 30 triggered images of any concept that share one trigger direction (a
    learned trigger: the trigger dominates their features). A cohort of the 30 poisons and each concept's 4
    most central images: the poisons are each other's nearest images, the central clean images have their
    concept's other images around them, so the purity rule keeps exactly the poisons (seeds 0-5)."""
    from reprlab.methods.otcclip.defenses.consensus import neighbourhood_share

    for seed in range(6):
        img, clean, c, y = _trigger_cluster(seed)
        central = (
            (F.normalize(clean, dim=-1) * F.normalize(c[y], dim=-1)).sum(1).view(5, 40).topk(4, dim=1).indices
        )
        top = torch.zeros(230, dtype=torch.bool)
        top[(central + 40 * torch.arange(5)[:, None]).flatten()] = True
        top[200:] = True
        kept = top & (neighbourhood_share(img, top, k=10) >= 0.6)
        assert torch.equal(kept, torch.arange(230) >= 200), seed


def test_flag_cohort_purity_holds_only_the_cohort_members_that_pass():
    """Inside OTCCLIP: the held set is the cohort top share less the members whose nearest images are mostly
    outside the cohort (this epoch's top or held before)."""
    from reprlab.methods.otcclip.defenses.consensus import cohort_scores, neighbourhood_share

    kw = dict(flag_start=5, flag_until=5, flag_k=3, flag_duplicate_cos=2.0, flag_cohort_start=0,
              flag_cohort_share=0.5, flag_cohort_neighbours=4, flag_cohort_purity=0.5)  # fmt: skip
    tr = _flagged_trainer(**kw)
    img, txt = embed_images(tr.model, tr.data.images), embed_texts(tr.model, tr.ids, tr.mask)
    top = flag_top(cohort_scores(consensus_scores(img, txt, 3, 2.0), img, txt), 0.5)

    def kept(held):
        return top & (neighbourhood_share(img, top | held, 4, 2.0) >= 0.5)

    # a pair held at an earlier epoch counts as a cohort neighbour: pick one whose holding changes the verdict
    row = next(
        r for r in range(16) if not top[r] and not torch.equal(kept(torch.arange(16) == r), kept(top & False))
    )
    earlier = torch.arange(16) == row
    want = kept(earlier)
    assert want.any() and (top & ~want).any()  # the rule keeps some members and drops others here
    tr.state.held[row] = True
    stats = tr.impl.start_epoch(tr, 0, "otc")
    assert stats["cohort_flagged"] == int(want.sum())
    assert torch.equal(tr.state.held.cpu(), want | earlier)


def test_flag_cohort_purity_without_a_cohort_is_refused():
    from reprlab.errors import ConfigError
    from reprlab.methods.otcclip.config import DefenseConfig
    from reprlab.methods.otcclip.defenses import make_defense

    with pytest.raises(ConfigError, match="flag_cohort_purity acts on a held cohort"):
        make_defense("otcclip", DefenseConfig(flag="consensus", flag_cohort_purity=0.6))


def test_flag_cohort_persist_holds_a_pair_only_after_that_many_cohort_epochs_in_a_row():
    """persist=2: the first cohort epoch holds nothing (each top member's streak is 1), the second holds the
    members that were in the top both times; a pair out of the top at a cohort epoch starts again from 0. The
    streak is trainer state, so a resumed run continues it."""
    from reprlab.methods.otcclip.defenses.consensus import cohort_scores

    kw = dict(flag_start=5, flag_until=5, flag_k=3, flag_duplicate_cos=2.0, flag_cohort_start=0,
              flag_cohort_epochs=3, flag_cohort_share=0.25, flag_cohort_persist=2)  # fmt: skip
    tr = _flagged_trainer(**kw)
    img, txt = embed_images(tr.model, tr.data.images), embed_texts(tr.model, tr.ids, tr.mask)
    top = flag_top(cohort_scores(consensus_scores(img, txt, 3, 2.0), img, txt), 0.25)
    stats = tr.impl.start_epoch(tr, 0, "otc")
    assert stats["cohort_flagged"] == 0 and not tr.state.held.any() and tr.state.safe.all()
    assert torch.equal(tr.state.streak.cpu(), top.long())
    resumed = _flagged_trainer(**kw)
    for k, m in resumed.modules().items():
        m.load_state_dict(tr.modules()[k].state_dict())
    tr.state.streak[~top.to(tr.state.streak.device)] = 5  # out of the top now: must restart at 0
    for t in (tr, resumed):
        stats = t.impl.start_epoch(t, 1, "otc")  # the same model: the same top, in it twice in a row
        assert stats["cohort_flagged"] == int(top.sum()) and torch.equal(t.state.held.cpu(), top)
        assert torch.equal(t.state.streak.cpu(), 2 * top.long())
    with pytest.raises(Exception, match="flag_cohort_persist acts on a held cohort"):
        _flagged_trainer(flag_cohort_persist=2)


def test_cohort_grow_reaches_a_held_triggers_other_poisons_and_no_scattered_clean_pair():
    """A learned trigger of which only some poisons are held (half of them) and
    two stray clean pairs held with it: the unheld poisons have held poisons among their nearest images, the
    clean images do not (at most the two strays), so growing at a share of 0.3 adds exactly the other poisons
    (seeds 0-5)."""
    from reprlab.methods.otcclip.defenses.consensus import neighbourhood_share

    for seed in range(6):
        img = _trigger_cluster(seed)[0]
        held = torch.zeros(230, dtype=torch.bool)
        held[200:215] = True  # half the poisons
        held[[3, 77]] = True  # two stray clean pairs of different concepts
        grown = ~held & (neighbourhood_share(img, held, k=10) >= 0.3)
        assert torch.equal(grown, torch.arange(230) >= 215), seed


def test_flag_cohort_grow_holds_the_pairs_whose_nearest_images_are_held():
    """Inside OTCCLIP (planted data: each class's images are one feature, so a class's images are each other's
    nearest): with two of a three-image class held by hand, the third has both its 2 nearest images held and is
    grown; every other image's 2 nearest are of its own class, so no other pair is. The held set after the epoch
    is the earlier one, the cohort's top share and the grown pair, written out with ``neighbourhood_share``. Two
    images of another three-image class are flagged, not held: they do not grow their class's third. Broken on
    purpose (the grown pairs not held; the share taken over flagged as well as held pairs) it fails."""
    from reprlab.methods.otcclip.defenses.consensus import cohort_scores, neighbourhood_share

    kw = dict(flag_start=5, flag_until=5, flag_k=3, flag_duplicate_cos=2.0, flag_cohort_start=0,
              flag_cohort_share=1 / 16, flag_cohort_neighbours=2, flag_cohort_grow=0.5)  # fmt: skip
    tr = _flagged_trainer(**kw)
    img, txt = embed_images(tr.model, tr.data.images), embed_texts(tr.model, tr.ids, tr.mask)
    top = flag_top(cohort_scores(consensus_scores(img, txt, 3, 2.0), img, txt), 1 / 16)
    cls = image_class(tr.data).cpu()
    pick, other = [k for k in cls.unique() if (cls == k).sum() == 3 and not top[cls == k].any()][:2]
    flagged = torch.zeros(16, dtype=torch.bool)
    flagged[torch.nonzero(cls == other).flatten()[:2]] = True
    earlier = torch.zeros(16, dtype=torch.bool)
    earlier[torch.nonzero(cls == pick).flatten()[:2]] = True
    grow = ~earlier & (neighbourhood_share(img, earlier, 2, 2.0) >= 0.5)
    assert torch.equal(grow, (cls == pick) & ~earlier)  # the known answer: the class's other images
    tr.state.held[earlier.to(tr.state.held.device)] = True
    tr.state.safe[(earlier | flagged).to(tr.state.safe.device)] = False  # held pairs are flagged too
    stats = tr.impl.start_epoch(tr, 0, "otc")
    assert stats["cohort_grow"] == int((grow & ~top).sum()) > 0
    assert torch.equal(tr.state.held.cpu(), earlier | top | grow)
    assert not tr.state.safe.cpu()[earlier | top | grow | flagged].any()
    assert tr.state.safe.cpu()[(cls == other) & ~flagged & ~top].all()
    off = _flagged_trainer(**{**kw, "flag_cohort_grow": 0.0})
    off.state.held[earlier.to(off.state.held.device)] = True
    assert "cohort_grow" not in off.impl.start_epoch(off, 0, "otc")
    assert torch.equal(off.state.held.cpu(), earlier | top)
    with pytest.raises(Exception, match="flag_cohort_grow acts on a held cohort"):
        _flagged_trainer(flag_cohort_grow=0.3)
