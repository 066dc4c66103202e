"""Image preprocessing: stored or decoded images are ``uint8 (C, S, S)`` at the model's input size; models take
float in [-1, 1] (:func:`to_input`) and map that to their own normalisation.

Decoding is the model's own geometry (:func:`model_transform`): shorter side resized to the model's input size
(bicubic, as CLIP's processor) and centre-cropped, kept ``uint8``; TinyCLIP takes [-1, 1] itself, the Hugging Face
adapter applies its processor's mean and std, the open_clip adapter its preprocess_cfg mean, std and size (whose
``resize_mode='shortest'`` + bicubic this decode matches). An image already at the input size is not resampled, so
shards of our mosaics stream back the exact pixels.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


def to_input(images: torch.Tensor) -> torch.Tensor:
    """``uint8 (B, C, H, W)`` -> float in [-1, 1]."""
    return images.float() / 127.5 - 1.0


@dataclass(frozen=True)
class ImageTransform:
    """Decode to ``uint8 (channels, size, size)``: shorter side resized to ``size`` (bicubic), centre crop."""

    size: int
    channels: int

    def __call__(self, src: bytes | Path) -> torch.Tensor:
        from PIL import Image

        with Image.open(io.BytesIO(src) if isinstance(src, bytes) else src) as im:
            mode = "L" if self.channels == 1 else "RGB"
            if im.mode != mode:  # a no-op convert still copies: a tenth of a decode's time
                im = im.convert(mode)
            return to_uint8(fit_image(im, self.size))


def fit_image(im, size: int):
    """A PIL image resized (bicubic) so its shorter side is ``size``, then centre-cropped to ``size x size``;
    returned as is when it is already that size."""
    from PIL import Image

    w, h = im.size
    if (w, h) == (size, size):
        return im
    s = size / min(w, h)
    nw, nh = max(size, round(w * s)), max(size, round(h * s))
    im = im.resize((nw, nh), Image.Resampling.BICUBIC)
    left, top = (nw - size) // 2, (nh - size) // 2
    return im.crop((left, top, left + size, top + size))


def to_uint8(im) -> torch.Tensor:
    """A PIL image (``L`` or ``RGB``) -> ``uint8 (C, H, W)``."""
    arr = np.array(im, dtype=np.uint8)
    arr = arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)
    return torch.from_numpy(np.ascontiguousarray(arr))


def model_transform(model) -> ImageTransform:
    """The model's own input geometry: TinyCLIP's ``image_size`` and channel count; a Hugging Face or open_clip
    adapter's ``image_size`` (open_clip: its preprocess_cfg ``size``) in RGB (mean/std are applied inside)."""
    if hasattr(model, "patch_embed"):
        return ImageTransform(model.cfg.image_size, model.patch_embed.in_channels)
    return ImageTransform(model.image_size, 3)
