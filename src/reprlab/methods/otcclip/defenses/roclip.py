"""RoCLIP [``BigML-CS-UCLA/RoCLIP``, ``model/src/train.py``, ``memory_bank.py``].

On matching epochs each image's caption embedding is replaced by its nearest neighbour (maximum cosine) in
a FIFO bank of caption embeddings, **queried before this batch's captions are enqueued**; the loss is
symmetric InfoNCE between the images and these detached neighbours (no text gradient). Other epochs use
the plain CLIP loss.
"""

from __future__ import annotations

import torch

from reprlab.methods.otcclip.defenses.base import Assignment, Batch, Defense, StepOutput, clip_step, register
from reprlab.methods.otcclip.defenses.losses import clip_loss
from reprlab.methods.otcclip.defenses.matching import nn_rematch
from reprlab.train.dist import all_gather_nograd, all_gather_with_grad


@register
class RoCLIP(Defense):
    name = "roclip"
    partial_grad = True  # see Defense.partial_grad
    uses_bank = True
    match_phases = ("roclip_match",)

    def phase(self, epoch: int) -> str:
        return "roclip_match" if self.is_match_epoch(epoch) else "clip"

    def step(self, tr, b: Batch) -> StepOutput:
        if b.phase != "roclip_match":
            return clip_step(tr, b)
        model = tr.model
        img = model.encode_image(b.view1)
        with torch.no_grad():
            txt = model.encode_text(b.ids1, b.mask1)
        if len(tr.bank) == 0:
            raise RuntimeError("RoCLIP matching epoch with an empty caption bank; set rematch_warmup >= 1")
        pool = tr.bank.entries()  # query first ...
        match = nn_rematch(img.global_.detach(), pool["global_"])
        target = all_gather_nograd(pool["global_"][match.index])
        loss = clip_loss(all_gather_with_grad(img.global_), target, model.scale())
        i = match.index  # indexing copies: the bank views in ``pool`` change when the batch is enqueued
        assignment = Assignment(i, pool["ids"][i], pool["sig"][i], pool["poison"][i])
        tr.enqueue(b.ids1, b.mask1, txt, b.loc)  # ... then enqueue (RoCLIP's order)
        return StepOutput(loss, {"clip": float(loss.detach())}, assignment)
