"""Copies of one image count as one pair [ours; docs/otcclip_testbed.md, "Copies count once"].

A targeted poison repeats one image with many captions (RoCLIP's protocol: 40 here), so one image carries
40 pairs' worth of gradient from the first step, and the per-epoch log shows it learned by epochs 1-3, before
any flag can act. Web pipelines deduplicate images for the same reason (one photo should not outweigh the
rest); this does it inside the loss, so nothing is dropped: a pair whose image has c copies in the training set
(itself included) weighs 1/c in the cross-modal terms, and an image with no copy is untouched (weight 1, so on
data without copies the run is the one without the option, bit for bit).

Copies are found from the pixels before training (the flag's feature-space duplicates exist only from the
flag's first epoch): an average hash on a ``grid x grid`` mean-pooled grey image (a pixel is 1 where it is
above the image's mean), or exact pixel equality with ``grid=0``. Measured on the web-like testbed: a 16 x 16
hash gives 20 of its 5,000 clean images one look-alike (an 8 x 8 hash: 1,904) and every copy of a targeted
poison the same key; uniform pixel noise of +-2 levels changes the key of 12 % of its images (+-8: 32 %), so
copies perturbed one by one escape it (the flag's feature-space copies, ``flag_duplicate_cos``, are then the
line that groups them). Flat images all hash alike (no cell above the mean): blank placeholders count as
copies of each other, as a deduplicator would have them.

:func:`spread_to_duplicates` is the feature-space side: the consensus flag's verdict (and its release's) spreads
over copies of one image.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F


def image_keys(images: torch.Tensor, grid: int, chunk: int = 4096) -> list[bytes]:
    """One hashable key per image of ``images (N, C, H, W)`` (any dtype): equal keys = copies."""
    keys: list[bytes] = []
    for start in range(0, len(images), chunk):
        x = images[start : start + chunk]
        if grid == 0:
            flat = x.reshape(len(x), -1).cpu().contiguous()
            keys += [row.numpy().tobytes() for row in flat]
            continue
        grey = F.adaptive_avg_pool2d(x.float().mean(1, keepdim=True), grid).flatten(1)
        bits = (grey > grey.mean(1, keepdim=True)).cpu()
        keys += [row.numpy().tobytes() for row in bits]
    return keys


def copy_weights(images: torch.Tensor, grid: int = 16) -> torch.Tensor:
    """``float32 (N,)``: 1 / (the number of images sharing this image's key), so each set of copies weighs one."""
    keys = image_keys(images, grid)
    count = Counter(keys)
    return torch.tensor([1.0 / count[k] for k in keys], dtype=torch.float32)


class CopyWeights:
    """:func:`copy_weights` of a trainer's whole training set, computed at the first call and kept (the set
    does not change during a run; a resumed run recomputes the same values from the same pixels)."""

    def __init__(self, grid: int):
        self.grid = grid
        self._weights: torch.Tensor | None = None
        self._any = False

    def rows(self, tr, idx: torch.Tensor) -> torch.Tensor | None:
        """``(len(idx),)`` weights of the training pairs ``idx`` of the in-memory trainer ``tr``; None where the
        set has no copies, so the loss takes its unweighted path (the run without the option, bit for bit)."""
        if self._weights is None:
            self._weights = copy_weights(tr.data.images, self.grid).to(tr.device)
            self._any = bool((self._weights < 1).any())
        return self._weights[idx.to(self._weights.device)] if self._any else None


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
