"""Neighbour-consensus flagging of image-caption pairs [ours; docs/otcclip_testbed.md, "A consensus flag"].

A pair whose caption is shared by many other pairs' captions, but whose image looks unlike those pairs' images, is
a mismatch: a backdoor image (any item plus a trigger) carries a target-class caption, and the images of the
target-class captions are target-class items. The score reads only the model's features, never provenance:

    s_i = - mean_{j in N_k(i)} cos(u_i, u_j),

``N_k(i)`` the ``k`` captions nearest to caption i (text features), leaving out pairs whose image is a
near-duplicate of image i (cosine above ``duplicate_cos``), so that copies of one image cannot vouch for each other.
Higher = less supported. The same idea with the roles swapped (captions of the nearest images) is
``consensus_scores(..., side="image")``.

OTCCLIP's ``flag='consensus'`` (:func:`update_flags`, :func:`batch_flags`, :func:`flagged_inmodal_loss`): before
each epoch from ``flag_start`` to ``flag_until`` the least-supported ``flag_share`` of all pairs are flagged (flags
accumulate in the trainer's checkpointed per-pair ``state.safe``; ``flag_duplicates`` spreads them to copies); from
``flag_release_epoch`` flagged pairs that score like the accepted ones rejoin; flagged pairs leave the CLIP and
inter-OT terms and, with ``flagged_train='inmodal'``, train an in-modality InfoNCE on two views of image and caption
(``'inmodal_all'``: from ``flag_start`` every pair trains it as well).
"""

from __future__ import annotations

import torch

from reprlab.methods.otcclip.data.pairs import BACKDOOR, TARGETED
from reprlab.methods.otcclip.defenses.copies import spread_to_duplicates
from reprlab.methods.otcclip.defenses.losses import unimodal_loss
from reprlab.methods.otcclip.defenses.release import released, releases, veto, veto_seed
from reprlab.methods.otcclip.models.embed import embed_images, embed_texts
from reprlab.train.dist import all_gather_nograd, all_gather_with_grad


@torch.no_grad()
def consensus_scores(
    img: torch.Tensor,
    txt: torch.Tensor,
    k: int = 50,
    duplicate_cos: float = 0.999,
    side: str = "text",
    chunk: int = 1024,
    voters: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mismatch score of each pair; ``img``/``txt (N, d)`` L2-normalised global features -> ``(N,)``.

    ``side='text'``: neighbours by caption, agreement of images (the default); ``side='image'``: neighbours by
    image, agreement of captions. Pairs with fewer than ``k`` eligible neighbours average over those they have.
    Computed in row chunks of ``chunk`` queries, so memory is ``chunk x N``. ``voters``: optional ``bool (N,)``;
    only these pairs can be neighbours (every pair is still scored).
    """
    if img.shape != txt.shape or img.ndim != 2:
        raise ValueError(f"img and txt must both be (N, d); got {tuple(img.shape)} and {tuple(txt.shape)}")
    if side not in ("text", "image"):
        raise ValueError(f"side must be 'text' or 'image', got {side!r}")
    n = len(img)
    if n < 2:
        return torch.zeros(n, dtype=img.dtype)
    k = min(k, n - 1)
    query, agree = (txt, img) if side == "text" else (img, txt)
    out = torch.empty(n, dtype=img.dtype, device=img.device)
    for rows, nn, ok in _nearest(query, img, k, duplicate_cos, chunk, voters):
        agreement = (agree[rows, None, :] * agree[nn]).sum(-1)
        out[rows] = -(agreement * ok).sum(1) / ok.sum(1).clamp(min=1)
    return out


def _nearest(query, img, k: int, duplicate_cos: float, chunk: int, voters: torch.Tensor | None = None):
    """Yield ``(rows, nn, ok)`` per chunk of ``chunk`` rows: ``nn (rows, k)`` the ``k`` nearest pairs by ``query
    (N, d)`` cosine, never the pair itself nor a near-duplicate of its image (``img (N, d)`` cosine above
    ``duplicate_cos``) nor a non-voter; ``ok (rows, k)`` False where fewer than ``k`` were eligible."""
    n = len(query)
    for s in range(0, n, chunk):
        rows = torch.arange(s, min(s + chunk, n), device=query.device)
        sim = query[rows] @ query.T
        dup = img[rows] @ img.T > duplicate_cos
        dup[torch.arange(len(rows)), rows] = True  # a pair is never its own neighbour
        if voters is not None:
            dup |= ~voters[None, :]
        val, nn = sim.masked_fill(dup, float("-inf")).topk(k, dim=1)
        yield rows, nn, torch.isfinite(val)


def ranks(x: torch.Tensor) -> torch.Tensor:
    """``(N,)`` -> each entry's rank over ``x`` scaled to [0, 1) (ties broken by index, so it is deterministic)."""
    out = torch.empty(len(x), dtype=torch.float32, device=x.device)
    out[torch.sort(x, stable=True).indices] = torch.arange(len(x), device=x.device, dtype=torch.float32)
    return out / max(len(x), 1)


@torch.no_grad()
def memorised_mismatch_scores(consensus: torch.Tensor, img: torch.Tensor, txt: torch.Tensor) -> torch.Tensor:
    """``flag='consensus_fit'`` [ours; docs/otcclip_testbed.md, "Fit as well as consensus"]: the rank of the
    consensus score plus the rank of the pair's own image-caption cosine, ``(N,)``. A pair the model fits unusually
    well although its image is unlike its caption's neighbours' images is a mismatch it has memorised: poisons
    that vouch for each other (one full-image trigger, repeated targeted images) are learned early and fit their
    captions better than clean pairs do. Ranks, so that neither term's scale decides. ``img``/``txt (N, d)`` unit
    rows, ``consensus (N,)`` from :func:`consensus_scores`."""
    return ranks(consensus) + ranks((img * txt).sum(1).to(consensus.device))


@torch.no_grad()
def cohort_scores(consensus: torch.Tensor, img: torch.Tensor, txt: torch.Tensor) -> torch.Tensor:
    """``flag_cohort_share`` [ours; docs/otcclip_testbed.md, "A learned trigger is a cohort"]: the rank of the
    support (minus the consensus score) plus the rank of the own-pair cosine, ``(N,)``. Once a trigger is learned,
    its poisons show one feature whatever item they show, so they vouch for each other better than any concept's
    clean pairs do and fit their captions better too: the top of this score is that cohort, or, with no trigger
    learned, the best-learned clean pairs, which lose the least by leaving the cross-modal loss.
    ``consensus (N,)`` from :func:`consensus_scores`; ``img``/``txt (N, d)`` unit rows. The consensus_fit score
    with the support's rank in place of the mismatch's."""
    return memorised_mismatch_scores(-consensus, img, txt)


@torch.no_grad()
def neighbourhood_share(
    img: torch.Tensor, group: torch.Tensor, k: int = 20, duplicate_cos: float = 0.999, chunk: int = 1024
) -> torch.Tensor:
    """``flag_cohort_purity`` [ours; docs/otcclip_testbed.md, "A trigger is its own neighbourhood"]: for each pair,
    the share of its ``k`` nearest images (cosine of ``img (N, d)`` unit rows) that are in ``group bool (N,)``,
    leaving out near-duplicates of its own image (cosine above ``duplicate_cos``) -> ``(N,)``. Once a trigger is
    learned, its images' nearest images are the other triggered images, whatever item each shows; a clean
    concept's best-learned pairs have the concept's other, unflagged images around them."""
    return neighbourhood_shares(img, [group], k, duplicate_cos, chunk)[0]


@torch.no_grad()
def neighbourhood_shares(
    img: torch.Tensor,
    groups: list[torch.Tensor],
    k: int = 20,
    duplicate_cos: float = 0.999,
    chunk: int = 1024,
) -> list[torch.Tensor]:
    """:func:`neighbourhood_share` for several ``groups`` (each ``bool (N,)``) from one nearest-image search."""
    n = len(img)
    k = min(k, n - 1)
    outs = [torch.zeros(n, dtype=torch.float32, device=img.device) for _ in groups]
    if k < 1:
        return outs
    groups = [g.to(img.device) for g in groups]
    for rows, nn, ok in _nearest(img, img, k, duplicate_cos, chunk):
        for out, group in zip(outs, groups):
            out[rows] = (group[nn] & ok).sum(1).float() / ok.sum(1).clamp(min=1)
    return outs


def flag_top(scores: torch.Tensor, share: float) -> torch.Tensor:
    """``bool (N,)``: the ``round(share * N)`` highest scores (ties broken by index, so it is deterministic)."""
    n = len(scores)
    order = torch.sort(-scores, stable=True).indices
    out = torch.zeros(n, dtype=torch.bool, device=scores.device)
    out[order[: int(round(share * n))]] = True
    return out


@torch.no_grad()
def update_flags(cfg, tr, epoch: int) -> dict:
    """OTCCLIP's epoch-start flag update (``cfg``: its ``DefenseConfig``; ``tr``: the trainer view): on flagging
    epochs add the least-supported ``flag_share`` of all pairs (scored with the epoch-start model, un-augmented) to
    the flagged set ``~tr.state.safe``; from ``flag_release_epoch`` release flagged pairs scoring below the
    ``flag_release_quantile`` of the accepted pairs' scores. Logs the flagged share and, as diagnostics only, the
    share of poisons flagged (all, targeted, backdoor)."""
    c = cfg
    if c.flag == "none":
        return {}
    trust = epoch == c.trust_epoch
    flags = c.flag_start <= epoch <= c.flag_until
    release = releases(c, epoch) and (~tr.state.safe).any()
    cohort = 0 <= c.flag_cohort_start <= epoch < c.flag_cohort_start + c.flag_cohort_epochs
    stats = {}
    if flags or release or trust or cohort:
        img = embed_images(tr.model, tr.data.images)
        txt = embed_texts(tr.model, tr.ids, tr.mask)
        # [ours] flag_vouch='unflagged': a flagged pair cannot vouch for another, so poisons that support each
        # other lose that support once some of them are flagged
        voters = tr.state.safe.to(img.device) if c.flag_vouch == "unflagged" else None
        score = consensus_scores(img, txt, c.flag_k, c.flag_duplicate_cos, voters=voters)
        score = score.to(tr.state.safe.device)
        top = cohort_scores(score, img, txt) if cohort else None
        if top is not None:
            top = flag_top(top, c.flag_cohort_share)
            held = tr.state.held.to(top.device)
            grows = c.flag_cohort_grow > 0 and bool(held.any())
            if c.flag_cohort_purity > 0 or grows:  # one nearest-image search serves both tests
                in_cohort, in_held = neighbourhood_shares(
                    img, [top | held, held], c.flag_cohort_neighbours, c.flag_duplicate_cos
                )
            if c.flag_cohort_purity > 0:
                # a trigger's cohort is its own neighbourhood (this epoch's top or already held)
                top &= (in_cohort >= c.flag_cohort_purity).to(top.device)
            if grows:
                # [ours] a learned trigger's poisons outside this epoch's top are the held ones' nearest images
                grow = (in_held >= c.flag_cohort_grow).to(top.device) & ~held
                stats["cohort_grow"] = int((grow & ~top).sum())
                top |= grow
            if c.flag_cohort_persist > 1:
                # a learned trigger stays in the cohort epoch after epoch; a clean concept's best pairs come and go
                streak = tr.state.streak
                streak.copy_(torch.where(top.to(streak.device), streak + 1, torch.zeros_like(streak)))
                top = (streak >= c.flag_cohort_persist).to(top.device)
        if flags:
            # consensus_fit flags by fit as well; the release below reads consensus alone, because a flagged
            # pair stops training across modalities and so loses its fit whatever it is
            by = memorised_mismatch_scores(score, img, txt) if c.flag == "consensus_fit" else score
            new = flag_top(by, c.flag_share)
            if c.flag_duplicates:
                new = spread_to_duplicates(img, new.cpu(), c.flag_duplicate_cos).to(new.device)
            tr.state.safe &= ~new
        # the held cohort is registered with flag_cohort_start only
        back = released(c, score, tr.state.safe, img, getattr(tr.state, "held", None)) if release else None
        if back is not None:
            # the veto's backgrounds are drawn per run and epoch: a resumed run draws the same ones
            kept = veto(c, back, tr.state.safe, img, tr.model, tr.data.images, txt, veto_seed(tr.seed, epoch))
            if c.flag_release_veto > 0:
                stats["release_vetoed"] = int(back.sum()) - int(kept.sum())
            back = kept
            tr.state.safe |= back
            stats["released"] = int(back.sum())
        if top is not None:  # after the release; a cohort member is held for the rest of training
            tr.state.held |= top
            tr.state.safe &= ~top
            stats["cohort_flagged"] = int(top.sum())
        # the trusted phase: the most-supported trust_share of all pairs, among the unflagged, stay; the rest are
        # flagged
        if trust:
            kept = flag_top(-score.masked_fill(~tr.state.safe, float("inf")), c.trust_share)
            tr.state.safe &= kept.to(tr.state.safe.device)
    flagged = ~tr.state.safe.cpu()
    poison, kind = tr.poison.cpu(), tr.data.kind.cpu()

    def held(rows: torch.Tensor) -> float:  # diagnostics only: the flag never reads provenance
        return float(flagged[rows].float().mean()) if rows.any() else float("nan")

    return {
        **stats,
        "flagged_share": float(flagged.float().mean()),
        "poison_flagged": held(poison),
        "targeted_flagged": held(kind == TARGETED),
        "backdoor_flagged": held(kind == BACKDOOR),
    }


def batch_flags(tr, b) -> torch.Tensor | None:
    """``bool (local,)``: this rank's flagged rows of batch ``b``, or None when no row of the global batch is
    flagged (the same answer on every rank)."""
    flagged = ~tr.state.safe[b.loc.to(tr.device)]
    return flagged if bool(all_gather_nograd(flagged.any()[None]).any()) else None


def flagged_inmodal_loss(tr, b, img, own, rows: torch.Tensor, temperature: float) -> torch.Tensor:
    """In-modality InfoNCE (SafeCLIP's risky-set loss) over the chosen rows of the global batch (the flagged ones;
    every row with ``flagged_train='inmodal_all'``): first vs second view of each image and of each own caption.
    ``img``: the first views' ``ImageFeatures`` (local rows); ``own``: the own captions' first-view
    ``TextFeatures`` with gradient when the step has them, else None; ``rows bool (local,)``."""
    model, gather = tr.model, all_gather_with_grad
    if own is None:
        own = model.encode_text(b.ids1, b.mask1)
    img2, txt2 = model.encode_image(b.view2), model.encode_text(b.ids2, b.mask2)
    rows = all_gather_nograd(rows)
    if rows.sum() < 2:  # InfoNCE needs a negative
        return img.global_.sum() * 0.0
    a1, a2 = gather(img.global_)[rows], gather(img2.global_)[rows]
    t1, t2 = gather(own.global_)[rows], gather(txt2.global_)[rows]
    return unimodal_loss(a1, a2, temperature) + unimodal_loss(t1, t2, temperature)


def flagged_unlearn_loss(tr, b, img, own, rows: torch.Tensor, margin: str) -> torch.Tensor:
    """``flagged_unlearn`` [ours; docs/otcclip_testbed.md, "Unlearning what the flag holds"]: the mean over the
    global batch's flagged rows of ``relu(cos(u_i, w_i) - m_i)``, with gradient into the images only. A flagged
    pair only leaves the cross-modal terms, which does not unlearn a trigger learned before the flag; this pushes
    each flagged image away from its own caption down to a bound and no further: ``margin='random'``: m_i = the
    mean cosine of image i with the batch's other captions (a pair no closer than chance); ``'accepted'``: m_i =
    the median own-pair cosine of the batch's unflagged pairs (no flagged pair fits better than a typical
    accepted one). The bound makes it stop, unlike gradient ascent on the CLIP loss. Captions are detached,
    because a flagged caption is usually a class caption that clean pairs share. ``rows bool (local,)``."""
    if own is None:
        own = tr.model.encode_text(b.ids1, b.mask1)
    rows = all_gather_nograd(rows)
    u, w = all_gather_with_grad(img.global_), all_gather_nograd(own.global_.detach())
    if not rows.any():
        return img.global_.sum() * 0.0
    cos = u @ w.T  # [global, global]
    pos = cos.diagonal()
    if margin == "random":
        off = ~torch.eye(len(cos), dtype=torch.bool, device=cos.device)
        bar = (cos.detach() * off).sum(1) / off.sum(1).clamp(min=1)
    elif (~rows).any():
        bar = pos.detach()[~rows].median().expand(len(pos))
    else:  # nothing accepted in this batch to compare with: no bound to push to
        return img.global_.sum() * 0.0
    return torch.relu(pos - bar)[rows].mean()


def flag_terms(c, tr, b, img, own, flagged: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The flag's extra loss terms of one step (``c``: OTCCLIP's ``DefenseConfig``; ``flagged bool (local,)`` or
    None when no row of the global batch is flagged): ``inmodal`` (``flagged_train``) and ``unlearn``
    (``flagged_unlearn``), unweighted."""
    terms = {}
    if c.flag == "none":
        return terms
    if c.flagged_train == "inmodal_all" and b.epoch >= c.flag_start:
        rows = torch.ones(len(b.ids1), dtype=torch.bool, device=tr.device)
        terms["inmodal"] = flagged_inmodal_loss(tr, b, img, own, rows, c.unimodal_temperature)
    elif flagged is not None and c.flagged_train == "inmodal":
        terms["inmodal"] = flagged_inmodal_loss(tr, b, img, own, flagged, c.unimodal_temperature)
    if flagged is not None and c.flagged_unlearn > 0:
        # 'held': the held cohort only, not every flagged pair (options.py refuses it without flag_cohort_start)
        rows = tr.state.held[b.loc.to(tr.device)] if c.flagged_unlearn_rows == "held" else flagged
        terms["unlearn"] = flagged_unlearn_loss(tr, b, img, own, rows, c.flagged_unlearn_margin)
    return terms
