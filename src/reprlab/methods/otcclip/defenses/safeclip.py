"""SafeCLIP [``BigML-CS-UCLA/SafeCLIP``, ``src/train.py``; epochs scaled down, ours].

``unimodal`` (two views per modality, in-modality InfoNCE) for the first ``safeclip_unimodal_epochs``, then
one ``clip_lowlr`` epoch at ``lr * safeclip_clip_lr_scale``, then ``safe_split`` epochs: before each, a
2-component Gaussian mixture on all pair cosines splits the data into safe pairs (CLIP loss) and risky pairs
(unimodal loss only). The first split keeps p(clean) >= ``safeclip_first_p``; later ones the top ``ratio``
by cosine, the ratio growing by ``safeclip_ratio_step`` per epoch up to ``safeclip_ratio_max``.
[ours] In-modality negatives are the batch, not SafeCLIP's 256-entry nearest-neighbour bank.
"""

from __future__ import annotations

import numpy as np
import torch

from reprlab.methods.otcclip.defenses.base import Batch, Defense, StepOutput, clip_step, register
from reprlab.methods.otcclip.defenses.losses import clip_loss, unimodal_loss
from reprlab.methods.otcclip.models.embed import embed_images, embed_texts
from reprlab.train.dist import all_gather_with_grad


def split_safe(cos: np.ndarray, first: bool, first_p: float, ratio: float, seed: int) -> np.ndarray:
    """SafeCLIP's split of pairs by their image-caption cosine ``cos (N,)`` -> ``safe bool (N,)``.

    First split: a 2-component GMM on ``cos``; safe = p(high-mean component) >= ``first_p``. Later splits:
    the top ``ratio`` share by cosine (at least one pair).
    """
    if first:
        from sklearn.mixture import GaussianMixture  # lazy: sklearn import is slow and only SafeCLIP needs it

        gmm = GaussianMixture(2, random_state=seed).fit(cos[:, None])
        clean = int(np.argmax(gmm.means_.ravel()))
        return gmm.predict_proba(cos[:, None])[:, clean] >= first_p
    safe = np.zeros(len(cos), bool)
    safe[np.argsort(-cos)[: max(1, int(round(ratio * len(cos))))]] = True
    return safe


@register
class SafeCLIP(Defense):
    name = "safeclip"
    partial_grad = True  # see Defense.partial_grad

    def phase(self, epoch: int) -> str:
        u = self.cfg.safeclip_unimodal_epochs
        return "unimodal" if epoch < u else ("clip_lowlr" if epoch == u else "safe_split")

    def lr_scale(self, phase: str) -> float:
        return self.cfg.safeclip_clip_lr_scale if phase == "clip_lowlr" else 1.0

    def ratio(self, epoch: int) -> float:
        """Safe share of the non-first splits."""
        c, u = self.cfg, self.cfg.safeclip_unimodal_epochs
        return min(c.safeclip_ratio_max, c.safeclip_ratio_start + c.safeclip_ratio_step * (epoch - u - 2))

    @torch.no_grad()
    def start_epoch(self, tr, epoch: int, phase: str) -> dict:
        """Re-split all pairs by their current cosine; logs the safe share and the poisons sent to risky."""
        if phase != "safe_split":
            return {}
        img = embed_images(tr.model, tr.data.images)
        txt = embed_texts(tr.model, tr.ids, tr.mask)
        cos = (img * txt).sum(1).numpy().astype(np.float64)
        first = epoch == self.cfg.safeclip_unimodal_epochs + 1
        safe = torch.from_numpy(split_safe(cos, first, self.cfg.safeclip_first_p, self.ratio(epoch), tr.seed))
        tr.state.safe.copy_(safe.to(tr.device))
        poison = tr.poison
        return {
            "safe_share": float(safe.float().mean()),
            "poison_in_risky": float((~safe[poison]).float().mean()) if poison.any() else float("nan"),
        }

    def step(self, tr, b: Batch) -> StepOutput:
        if b.phase == "clip_lowlr":
            return clip_step(tr, b)
        model, gather, tau = tr.model, all_gather_with_grad, self.cfg.unimodal_temperature
        a1, a2 = model.encode_image(b.view1), model.encode_image(b.view2)
        t1, t2 = model.encode_text(b.ids1, b.mask1), model.encode_text(b.ids2, b.mask2)
        ga1, ga2, gt1, gt2 = gather(a1.global_), gather(a2.global_), gather(t1.global_), gather(t2.global_)
        if b.phase == "unimodal":
            loss = unimodal_loss(ga1, ga2, tau) + unimodal_loss(gt1, gt2, tau)
            return StepOutput(loss, {"unimodal": float(loss.detach())})
        safe = tr.state.safe[b.idx.to(tr.device)]  # global batch rows
        terms = {}
        loss = ga1.sum() * 0.0  # keeps the graph when one side is empty
        if safe.sum() >= 2:
            clip = clip_loss(ga1[safe], gt1[safe], model.scale())
            loss, terms["clip"] = loss + clip, float(clip.detach())
        if (~safe).sum() >= 2:
            uni = unimodal_loss(ga1[~safe], ga2[~safe], tau) + unimodal_loss(gt1[~safe], gt2[~safe], tau)
            loss, terms["unimodal"] = loss + uni, float(uni.detach())
        return StepOutput(loss, terms)
