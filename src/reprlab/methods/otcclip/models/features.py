"""The interface every CLIP here exposes, and the helpers on its outputs.

A model is any module with ``encode_image(float (batch, C, H, W)) -> ImageFeatures``,
``encode_text(ids, mask) -> TextFeatures``, ``scale()`` (exp of the clamped logit scale) and ``cfg`` with
``max_len`` and ``embed_dim``: TinyCLIP (``tiny``), the Hugging Face adapter (``hf``) and the open_clip adapter
(``openclip``). Trainer, defenses, evaluation and audit see only this interface.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

LOGIT_SCALE_MAX = math.log(100.0)  # clamp as in CLIP / RoCLIP code


@dataclass
class ImageFeatures:
    """``global_ (batch, d)`` and ``patches (batch, n, d)``, both L2-normalised; ``mask (batch, n)`` all True."""

    global_: torch.Tensor
    patches: torch.Tensor
    mask: torch.Tensor


@dataclass
class TextFeatures:
    """``global_ (batch, d)`` and ``tokens (batch, m, d)``, L2-normalised; ``mask (batch, m)`` True on words."""

    global_: torch.Tensor
    tokens: torch.Tensor
    mask: torch.Tensor


@dataclass(frozen=True)
class AdapterSizes:
    """The two sizes the trainer reads from ``model.cfg`` (an adapter's stand-in for ``ModelConfig``)."""

    max_len: int
    embed_dim: int


def clip_pixels(
    images: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, size: int, pixel_norm: bool
) -> torch.Tensor:
    """Trainer images ``(batch, 1 or 3, H, W)`` in [-1, 1] -> a CLIP vision tower's input ``(batch, 3, size, size)``:
    greyscale repeated to 3 channels, the model's own mean/std (with ``pixel_norm``; else the images are taken as
    already normalised), bilinear resize to its input size. Shared by the HF and open_clip adapters."""
    if images.shape[1] == 1:
        images = images.expand(-1, 3, -1, -1)
    if pixel_norm:
        images = ((images + 1) / 2 - mean) / std
    if images.shape[-1] != size or images.shape[-2] != size:
        images = F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False)
    return images


def trim(txt: TextFeatures, width: int) -> TextFeatures:
    """The first ``width`` token positions of ``txt`` (the global embedding is unchanged)."""
    return TextFeatures(txt.global_, txt.tokens[:, :width], txt.mask[:, :width])


def merge_rows(take_first: torch.Tensor, first: TextFeatures, second: TextFeatures) -> TextFeatures:
    """Row ``r`` from ``first`` where ``take_first[r]`` else from ``second``; token sets right-padded with
    zero features / ``False`` to the wider of the two."""
    width = max(first.tokens.shape[1], second.tokens.shape[1])

    def pad(t: TextFeatures) -> tuple[torch.Tensor, torch.Tensor]:
        extra = width - t.tokens.shape[1]
        return F.pad(t.tokens, (0, 0, 0, extra)), F.pad(t.mask, (0, extra))

    (tok1, mask1), (tok2, mask2) = pad(first), pad(second)
    rows = take_first[:, None]
    return TextFeatures(
        torch.where(rows, first.global_, second.global_),
        torch.where(rows[:, :, None], tok1, tok2),
        torch.where(rows, mask1, mask2),
    )


def split_rows(feats, n: int) -> tuple:
    """Split Image/TextFeatures of stacked inputs into rows ``[:n]`` and ``[n:]`` (same feature class)."""
    values = [getattr(feats, f.name) for f in fields(feats)]  # global_, patches/tokens, mask
    return type(feats)(*(v[:n] for v in values)), type(feats)(*(v[n:] for v in values))


def cat_padded(ids: list[torch.Tensor], masks: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack ``(rows, pos)`` token batches of possibly different widths, right-padding with 0 / False."""
    width = max(t.shape[1] for t in ids)
    pad = [(0, width - t.shape[1]) for t in ids]
    return (
        torch.cat([F.pad(t, p) for t, p in zip(ids, pad)]),
        torch.cat([F.pad(m, p) for m, p in zip(masks, pad)]),
    )
