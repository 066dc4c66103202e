"""STRIP's superimposition test (Gao et al. 2019) for CLIP pairs, and a release veto that reads it [ours].

A learned trigger survives being blended into other images: the pair's caption stays close to its image blended
half and half into unrelated images, while a clean image's fit to its caption falls with the blend. OTCCLIP's
consensus flag releases flagged pairs that score like the accepted ones; once a trigger is learned the release
hands its poisons back first (docs/otcclip_testbed.md, "What the features tell at the release"), so
``defense.flag_release_veto`` keeps flagged the share of each release with the highest blend cosine.
"""

from __future__ import annotations

import torch

from reprlab.methods.otcclip.models.embed import embed_images

# accepted pairs' images a candidate is blended into (the flag probe's n_blend)
N_BACKGROUNDS = 8


@torch.no_grad()
def blend_cosine(model, images: torch.Tensor, txt: torch.Tensor, backgrounds: torch.Tensor, mix: float = 0.5):
    """``(R,)``: mean over ``backgrounds uint8 (B, C, H, W)`` of the cosine between ``txt (R, d)`` and the image
    ``(1 - mix) x + mix * background`` of each of ``images uint8 (R, C, H, W)``."""
    out = torch.zeros(len(images))
    if len(images) == 0:
        return out
    x = images.float()
    for bg in backgrounds.float():
        mixed = ((1 - mix) * x + mix * bg).round().clamp(0, 255).to(torch.uint8)
        out += (embed_images(model, mixed) * txt).sum(1)
    return out / max(len(backgrounds), 1)


def accepted_backgrounds(images: torch.Tensor, safe: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """``uint8 (min(n, accepted), C, H, W)``: ``n`` images of accepted pairs (``safe bool (N,)``), drawn with
    ``seed``; accepted ones so that a flagged trigger is not blended into every candidate."""
    g = torch.Generator().manual_seed(seed)
    accepted = torch.nonzero(safe.cpu()).flatten()
    return images[accepted[torch.randperm(len(accepted), generator=g)[:n]]]


@torch.no_grad()
def blend_veto(
    model,
    images: torch.Tensor,
    txt: torch.Tensor,
    back: torch.Tensor,
    safe: torch.Tensor,
    share: float,
    seed: int,
) -> torch.Tensor:
    """``bool (N,)``: the ``share`` (rounded) of the release ``back bool (N,)`` whose caption ``txt (N, d)`` keeps the
    highest cosine with its image ``images uint8 (N, C, H, W)`` blended into :data:`N_BACKGROUNDS` accepted pairs'
    images (``safe bool (N,)``, drawn with ``seed``); ties by index."""
    vetoed = torch.zeros(len(back), dtype=torch.bool)
    rows = torch.nonzero(back.cpu()).flatten()
    k = int(round(share * len(rows)))
    if k == 0:
        return vetoed
    score = blend_cosine(
        model, images[rows], txt[rows], accepted_backgrounds(images, safe, N_BACKGROUNDS, seed)
    )
    vetoed[rows[torch.argsort(-score, stable=True)[:k]]] = True
    return vetoed
