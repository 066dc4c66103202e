"""Backdoor triggers, following the CleanCLIP protocol [CleanCLIP, ``backdoor/utils.py``].

``TRIGGERS``: BadNets pastes a fixed noise patch (CleanCLIP: 16x16 on 224 px; ours: 8x8 on 56 px, same share
of the side) at the bottom-right corner (``badnets``) or at a random position per image (``badnets_random``);
blended mixes x' = 0.8 x + 0.2 noise; SIG [Barni et al., ICIP 2019] adds a horizontal sinusoid (amplitude 60
of 255 as CleanCLIP, 6 periods across the width); WaNet [Nguyen & Tran, ICLR 2021] resamples the image along a
smooth random displacement field (4x4 control grid upsampled bicubically; ours: at most 3 px, since
CleanCLIP's k = 224, s = 1 on 224 px is a per-pixel field, not WaNet's smooth one). Every trigger is a
deterministic function of its seed, so evaluation applies exactly the trained trigger to test images.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from reprlab.methods.otcclip.config import TRIGGERS


@dataclass(frozen=True)
class TriggerParams:
    """Trigger settings besides its kind (defaults ours, scaled from CleanCLIP's 224 px to our 56 px).

    ``patch``: BadNets patch side; ``alpha``: blended mix weight; ``sig_amplitude`` (pixel units, 0-255)
    and ``sig_frequency`` (periods across the width) of SIG; ``wanet_grid`` (control points per side) and
    ``wanet_strength`` (largest displacement in pixels) of WaNet.
    """

    patch: int = 8
    alpha: float = 0.2
    sig_amplitude: float = 60.0
    sig_frequency: float = 6.0
    wanet_grid: int = 4
    wanet_strength: float = 3.0


def trigger_pattern(kind: str, shape: tuple[int, int, int], seed: int, patch: int = 8) -> torch.Tensor:
    """Deterministic trigger pattern ``float (C, H, W)`` in [0, 255] (BadNets: only the patch is used)."""
    g = torch.Generator().manual_seed(seed)
    c, h, w = shape
    if kind in ("badnets", "badnets_random"):
        # binary noise patch, same in every channel so it survives greyscale
        return (torch.rand(1, patch, patch, generator=g) > 0.5).float().expand(c, -1, -1) * 255.0
    if kind == "blended":
        return torch.rand(1, h, w, generator=g).expand(c, -1, -1) * 255.0
    raise ValueError(f"unknown trigger pattern {kind!r}; patterns exist for 'badnets*' and 'blended'")


def patch_positions(n: int, size: tuple[int, int], seed: int, patch: int) -> torch.Tensor:
    """Random-position BadNets: ``(n, 2)`` top-left corners (row, col), uniform over the positions where
    a ``patch x patch`` square lies fully inside an ``(H, W)`` image; deterministic in ``seed``.

    [ours] drawn from their own stream (seed + 1), so the pattern (stream ``seed``) does not depend on ``n``.
    """
    h, w = size
    if patch > min(h, w):
        raise ValueError(f"patch {patch} does not fit in a {h}x{w} image")
    g = torch.Generator().manual_seed(seed + 1)
    return torch.stack(
        [
            torch.randint(0, h - patch + 1, (n,), generator=g),
            torch.randint(0, w - patch + 1, (n,), generator=g),
        ],
        dim=1,
    )


def sig_signal(shape: tuple[int, int, int], amplitude: float, frequency: float) -> torch.Tensor:
    """SIG [Barni et al. 2019]: ``v(i, j) = amplitude * sin(2 pi j frequency / W)``, ``float (C, H, W)``:
    a horizontal sinusoid with ``frequency`` periods across the width, the same on every row and channel."""
    c, h, w = shape
    j = torch.arange(w, dtype=torch.float64)
    row = amplitude * torch.sin(2 * math.pi * j * frequency / w)
    return row.float().expand(c, h, w)


def wanet_field(size: tuple[int, int], seed: int, grid: int, strength: float) -> torch.Tensor:
    """WaNet [Nguyen & Tran, ICLR 2021]: a smooth displacement field ``float (2, H, W)`` in pixels
    (``[0]`` along x / columns, ``[1]`` along y / rows).

    Random control values in [-1, 1] on a ``grid x grid`` lattice, upsampled bicubically to the image
    size (smooth), then scaled so the largest displacement is exactly ``strength`` pixels [ours: WaNet
    divides by the mean |value| and scales by s / H in grid units; a max-normalisation makes the bound
    explicit]. Deterministic in ``seed``.
    """
    h, w = size
    if grid < 2:
        raise ValueError(f"wanet_grid must be >= 2; got {grid}")
    g = torch.Generator().manual_seed(seed)
    control = torch.rand(1, 2, grid, grid, generator=g, dtype=torch.float64) * 2 - 1
    field = F.interpolate(control, size=(h, w), mode="bicubic", align_corners=True)[0]
    peak = field.abs().max()
    return (field / peak * strength).float() if strength > 0 else torch.zeros(2, h, w)


def warp(images: torch.Tensor, field: torch.Tensor) -> torch.Tensor:
    """Bilinear resampling ``out[y, x] = in[y + field[1], x + field[0]]`` (border-clamped) of
    ``float (N, C, H, W)`` images with a pixel displacement field ``(2, H, W)``."""
    n, _, h, w = images.shape
    ys, xs = torch.meshgrid(
        torch.arange(h, dtype=torch.float32), torch.arange(w, dtype=torch.float32), indexing="ij"
    )
    # pixel coordinates -> grid_sample's [-1, 1] with align_corners=True (pixel centres at -1 and 1)
    gx = (xs + field[0]) / max(w - 1, 1) * 2 - 1
    gy = (ys + field[1]) / max(h - 1, 1) * 2 - 1
    grid = torch.stack([gx, gy], dim=-1)[None].expand(n, -1, -1, -1)
    return F.grid_sample(images, grid, mode="bilinear", padding_mode="border", align_corners=True)


def apply_trigger(
    images: torch.Tensor, kind: str, seed: int, patch: int = 8, alpha: float = 0.2, **params
) -> torch.Tensor:
    """Add the trigger to ``uint8 (N, C, H, W)`` images; a deterministic function of ``(images, kind,
    seed, params)``.

    * ``badnets``: the noise patch at the bottom-right corner [ours: a fixed corner].
    * ``badnets_random``: the same patch at a random position per image, fully inside it (CleanCLIP's
      random location; positions from :func:`patch_positions`).
    * ``blended``: ``(1 - alpha) x + alpha noise`` with alpha = 0.2 as in CleanCLIP.
    * ``sig``: ``x + v`` with the :func:`sig_signal` sinusoid (CleanCLIP: amplitude 60/255, i.e. 60 here).
    * ``wanet``: :func:`warp` with :func:`wanet_field` (WaNet's noise mode is a separate step on the
      training set: :func:`add_wanet_noise`).

    Args:
        params: further :class:`TriggerParams` fields (``sig_amplitude``, ``sig_frequency``,
            ``wanet_grid``, ``wanet_strength``).
    """
    p = TriggerParams(patch=patch, alpha=alpha, **params)
    n, c, h, w = images.shape
    out = images.float()
    if kind == "badnets":
        out[:, :, -p.patch :, -p.patch :] = trigger_pattern(kind, (c, h, w), seed, p.patch)
    elif kind == "badnets_random":
        pattern = trigger_pattern(kind, (c, h, w), seed, p.patch)
        for i, (top, left) in enumerate(patch_positions(n, (h, w), seed, p.patch).tolist()):
            out[i, :, top : top + p.patch, left : left + p.patch] = pattern
    elif kind == "blended":
        out = (1 - p.alpha) * out + p.alpha * trigger_pattern(kind, (c, h, w), seed, p.patch)
    elif kind == "sig":
        out = out + sig_signal((c, h, w), p.sig_amplitude, p.sig_frequency)
    elif kind == "wanet":
        out = warp(out, wanet_field((h, w), seed, p.wanet_grid, p.wanet_strength))
    else:
        raise ValueError(f"unknown trigger {kind!r}; choose from {TRIGGERS}")
    return out.round().clamp(0, 255).to(torch.uint8)
