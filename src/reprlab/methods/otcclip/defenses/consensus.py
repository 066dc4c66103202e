"""Neighbour-consensus flagging of image-caption pairs [ours; docs/otcclip_testbed.md, "A consensus flag"].

A pair whose caption is shared by many other pairs' captions, but whose image looks unlike those pairs' images, is
a mismatch: a backdoor image (any item plus a trigger) carries a target-class caption, and the images of the
target-class captions are target-class items. The score reads only the model's features, never provenance:

    s_i = - mean_{j in N_k(i)} cos(u_i, u_j),

``N_k(i)`` the ``k`` captions nearest to caption i (text features), leaving out pairs whose image is a
near-duplicate of image i (cosine above ``duplicate_cos``), so that copies of one image cannot vouch for each other.
Higher = less supported. The same idea with the roles swapped (captions of the nearest images) is
``consensus_scores(..., side="image")``.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def consensus_scores(
    img: torch.Tensor,
    txt: torch.Tensor,
    k: int = 50,
    duplicate_cos: float = 0.999,
    side: str = "text",
    chunk: int = 1024,
) -> torch.Tensor:
    """Mismatch score of each pair; ``img``/``txt (N, d)`` L2-normalised global features -> ``(N,)``.

    ``side='text'``: neighbours by caption, agreement of images (the default); ``side='image'``: neighbours by
    image, agreement of captions. Pairs with fewer than ``k`` eligible neighbours average over those they have.
    Computed in row chunks of ``chunk`` queries, so memory is ``chunk x N``.
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
    for s in range(0, n, chunk):
        rows = torch.arange(s, min(s + chunk, n), device=img.device)
        sim = query[rows] @ query.T
        dup = img[rows] @ img.T > duplicate_cos
        dup[torch.arange(len(rows)), rows] = True  # a pair is never its own neighbour
        sim = sim.masked_fill(dup, float("-inf"))
        val, nn = sim.topk(k, dim=1)
        ok = torch.isfinite(val)
        agreement = (agree[rows, None, :] * agree[nn]).sum(-1)
        out[rows] = -(agreement * ok).sum(1) / ok.sum(1).clamp(min=1)
    return out


def flag_top(scores: torch.Tensor, share: float) -> torch.Tensor:
    """``bool (N,)``: the ``round(share * N)`` highest scores (ties broken by index, so it is deterministic)."""
    n = len(scores)
    order = torch.sort(-scores, stable=True).indices
    out = torch.zeros(n, dtype=torch.bool, device=scores.device)
    out[order[: int(round(share * n))]] = True
    return out


@torch.no_grad()
def spread_to_duplicates(
    img: torch.Tensor, flags: torch.Tensor, duplicate_cos: float = 0.999, chunk: int = 1024
) -> torch.Tensor:
    """``flags bool (N,)`` plus every pair whose image is a near-duplicate (cosine above ``duplicate_cos``) of a
    flagged pair's image; ``img (N, d)`` normalised. Copies of one image share a verdict: the consensus score
    judges an image against its caption's neighbours, so two copies with captions of one content are judged on
    the same evidence, and a copy left unflagged keeps teaching the association its flagged twin was held from."""
    out = flags.clone()
    marked = img[flags]
    if len(marked) == 0:
        return out
    for s in range(0, len(img), chunk):
        out[s : s + chunk] |= (img[s : s + chunk] @ marked.T > duplicate_cos).any(1)
    return out
