"""What OTCCLIP's consensus flag hands back, and when [ours; docs/otcclip_testbed.md, "A consensus flag"].

From ``flag_release_epoch`` (to ``flag_release_until``), before every epoch, flagged pairs whose consensus score is
below the ``flag_release_quantile`` of the accepted pairs' scores rejoin the cross-modal terms, as SafeCLIP grows
its safe set; copies are released together (``flag_release_together``), the held cohort never, and
``flag_release_veto`` keeps back the share of a release that the blend test points at (:mod:`.blend`).
"""

from __future__ import annotations

import torch

from reprlab.methods.otcclip.defenses.blend import blend_veto
from reprlab.methods.otcclip.defenses.copies import spread_to_duplicates


def release_mask(score: torch.Tensor, safe: torch.Tensor, img: torch.Tensor, quantile: float, together: bool,
                 duplicate_cos: float) -> torch.Tensor:  # fmt: skip
    """``bool (N,)``: the flagged pairs (``~safe``) whose ``score (N,)`` is below the ``quantile`` of the accepted
    pairs' scores; with ``together``, less every pair a near-duplicate of whose image (``img (N, D)``, unit rows,
    cosine above ``duplicate_cos``) stays flagged [ours: copies share the verdict on release as on flagging]."""
    bar = torch.quantile(score[safe], quantile)
    back = ~safe & (score < bar)
    if together:
        stay = spread_to_duplicates(img, (~safe & ~back).cpu(), duplicate_cos)
        back &= ~stay.to(back.device)
    return back


def released(
    cfg, score: torch.Tensor, safe: torch.Tensor, img: torch.Tensor, held: torch.Tensor | None = None
):
    """``bool (N,)``: what a release hands back from the flag state ``safe`` (OTCCLIP's ``DefenseConfig``
    ``cfg``; ``score (N,)`` consensus scores, ``img (N, D)`` unit rows): :func:`release_mask` at
    ``flag_release_quantile``, less the ``held`` cohort, which is never released; None when nothing is accepted
    to compare with. Whether an epoch releases at all is :func:`releases`; :func:`veto` may keep some back."""
    if not safe.any():
        return None
    back = release_mask(score, safe, img, cfg.flag_release_quantile, cfg.flag_release_together,
                        cfg.flag_duplicate_cos)  # fmt: skip
    return back if held is None else back & ~held.to(back.device)


def veto(cfg, back: torch.Tensor, safe: torch.Tensor, img: torch.Tensor, model, images, txt, seed: int):
    """``bool (N,)``: the release ``back`` (:func:`released`) less the ``flag_release_veto`` share of it that
    :func:`~.blend.blend_veto` keeps flagged (``images uint8 (N, C, H, W)``, ``txt (N, d)`` caption features, the
    backgrounds drawn with ``seed``), and with ``flag_release_together`` their copies (``img (N, D)``, cosine above
    ``flag_duplicate_cos``) too [ours]. ``back`` itself when the veto is off."""
    if cfg.flag_release_veto <= 0:
        return back
    vetoed = blend_veto(model, images, txt, back, safe, cfg.flag_release_veto, seed)
    if cfg.flag_release_together:
        vetoed = spread_to_duplicates(img.cpu(), vetoed, cfg.flag_duplicate_cos)
    return back & ~vetoed.to(back.device)


def veto_seed(seed: int, epoch: int) -> int:
    """The seed of the veto's backgrounds at ``epoch`` of a run seeded ``seed`` (the trainer's and the probe's)."""
    return seed * 1000 + epoch


def releases(cfg, epoch: int) -> bool:
    """Whether epoch ``epoch`` is a release epoch of OTCCLIP's ``DefenseConfig`` ``cfg`` (``flag_release_epoch``
    to ``flag_release_until``; never in the trusted phase)."""
    c = cfg
    if not 0 <= c.flag_release_epoch <= epoch or 0 <= c.flag_release_until < epoch:
        return False
    return not 0 <= c.trust_epoch <= epoch  # the trusted phase releases nothing
