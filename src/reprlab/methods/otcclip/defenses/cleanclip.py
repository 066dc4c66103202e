"""CleanCLIP [Bansal et al., ICCV 2023; ``nishadsinghi/CleanCLIP``, ``src/train.py``].

Fine-tuning objective: ``clip_weight * L_CLIP(u, w) + inmodal_weight * L_in`` with
``L_in = 1/2 [CE(s u u'^T) + CE(s w w'^T)]``: each image against its augmented view and each caption against its
augmented caption, cross-entropy over rows with diagonal targets, scaled by the model's own ``s = exp(t)``
(as in its code). CleanCLIP fine-tunes a pre-trained poisoned model on a clean set; our testbed has no
pre-trained model, so [ours] epochs before ``cleanclip_start_epoch`` are plain CLIP pre-training on the
poisoned pairs (phase ``clip``) and later epochs fine-tune with the CleanCLIP objective (phase ``cleanclip``).
With ``data.clean_finetune_pairs`` > 0 the fine-tuning epochs train on a separate set of clean mosaic pairs
(the trainer's ``clean`` set, :attr:`clean_phases`), as CleanCLIP does; with 0 (the old behaviour) they
fine-tune on the same poisoned pairs, which does not remove the attacks (docs/otcclip_attacks.md). Not in
the default defense list; add it with ``defenses=[...,cleanclip]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from reprlab.methods.otcclip.defenses.base import Batch, Defense, StepOutput, clip_step, register
from reprlab.methods.otcclip.defenses.losses import clip_loss
from reprlab.train.dist import all_gather_with_grad


def inmodal_loss(z: torch.Tensor, z_aug: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``scale * z z_aug^T`` over rows with diagonal targets; ``(batch, d)`` each."""
    logits = scale * z @ z_aug.T
    return F.cross_entropy(logits, torch.arange(len(z), device=z.device))


@register
class CleanCLIP(Defense):
    name = "cleanclip"
    clean_phases = ("cleanclip",)  # phases that train on the trainer's clean fine-tuning set, when given

    def phase(self, epoch: int) -> str:
        return "cleanclip" if epoch >= self.cfg.cleanclip_start_epoch else "clip"

    def lr_scale(self, phase: str) -> float:
        return self.cfg.cleanclip_lr_scale if phase == "cleanclip" else 1.0

    def step(self, tr, b: Batch) -> StepOutput:
        if b.phase != "cleanclip":
            return clip_step(tr, b)
        c, model, gather = self.cfg, tr.model, all_gather_with_grad
        img, img_aug = model.encode_image(b.view1), model.encode_image(b.view2)
        txt, txt_aug = model.encode_text(b.ids1, b.mask1), model.encode_text(b.ids2, b.mask2)
        u, u_aug, w, w_aug = (
            gather(img.global_),
            gather(img_aug.global_),
            gather(txt.global_),
            gather(txt_aug.global_),
        )
        scale = model.scale()
        cross = clip_loss(u, w, scale)
        inmodal = 0.5 * (inmodal_loss(u, u_aug, scale) + inmodal_loss(w, w_aug, scale))
        loss = c.cleanclip_clip_weight * cross + c.cleanclip_inmodal_weight * inmodal
        return StepOutput(loss, {"clip": float(cross.detach()), "inmodal": float(inmodal.detach())})
