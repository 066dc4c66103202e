"""Targeted data poisoning and backdoor triggers, following the RoCLIP / CleanCLIP protocols.

* Targeted [RoCLIP, ``model/create_poison.ipynb``]: each of T held-out target images (never used in
  training or evaluation) gets a wrong target class y_t and is paired with N real training captions that
  mention y_t as a whole word. ASR_targeted: share of targets whose zero-shot class is y_t.
* Backdoor [CleanCLIP, ``backdoor/utils.py``]: M training images get a trigger and a "a photo of a
  {target}" caption. Triggers (``TRIGGERS``): BadNets pastes a fixed noise patch (CleanCLIP: 16x16 on
  224 px; ours: 8x8 on 56 px, same share of the side) at the bottom-right corner (``badnets``) or at a
  random position per image (``badnets_random``); blended mixes x' = 0.8 x + 0.2 noise; SIG [Barni et
  al., ICIP 2019] adds a horizontal sinusoid (amplitude 60 of 255 as CleanCLIP, 6 periods across the
  width); WaNet [Nguyen & Tran, ICLR 2021] resamples the image along a smooth random displacement field
  (4x4 control grid upsampled bicubically; ours: at most 3 px, since CleanCLIP's k = 224, s = 1 on 224 px
  is a per-pixel field, not WaNet's smooth one). ASR_backdoor: share of triggered test images of true
  class != target classified as the target; evaluation applies the same trigger (same seed) to test
  images.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from reprlab.methods.otcclip.mosaic import (
    BACKDOOR,
    PROMPTS,
    TARGETED,
    PairSet,
    SignatureIndex,
    make_single_items,
)  # fmt: skip


def mentions(caption: str, class_name: str) -> bool:
    """Whole-word mention; hyphens count as word characters so that "shirt" does not match "t-shirt"."""
    return re.search(rf"(?<![\w-]){re.escape(class_name)}(?![\w-])", caption.lower()) is not None


@dataclass
class TargetSet:
    """Targeted-poison targets: ``images uint8 (T, C, H, W)``, ``true (T,)``, ``target (T,)`` class ids."""

    images: torch.Tensor
    true: torch.Tensor
    target: torch.Tensor


def add_targeted(
    pairs: PairSet,
    x: np.ndarray,
    y: np.ndarray,
    n_targets: int,
    n_captions: int,
    seed: int,
    tint: bool = False,
) -> tuple[PairSet, TargetSet]:
    """Append ``n_targets * n_captions`` targeted-poison pairs.

    Args:
        pairs: clean training pairs (their captions are the pool poison captions are drawn from).
        x, y: held-out item images ``uint8 (M, 28, 28)`` and labels the targets are drawn from.
        n_targets: T; n_captions: N captions per target.

    Raises:
        ValueError: fewer than N training captions mention a chosen target class.
    """
    rng = np.random.default_rng(seed)
    n_classes = len(pairs.class_names)
    picks = rng.choice(len(x), size=n_targets, replace=False)
    targets = make_single_items(x[picks], y[picks], seed=seed + 1, tint=tint)
    # target class: a random class different from the true one
    target_cls = (targets.labels + torch.from_numpy(rng.integers(1, n_classes, size=n_targets))) % n_classes
    new_images, new_caps, new_sig = [], [], []
    for t in range(n_targets):
        name = pairs.class_names[int(target_cls[t])]
        pool = [i for i, c in enumerate(pairs.captions) if pairs.kind[i] == 0 and mentions(c, name)]
        if len(pool) < n_captions:
            raise ValueError(f"only {len(pool)} training captions mention {name!r}; need {n_captions}")
        # [ours] the attacker prefers captions naming few other items (random order among equals): on a
        # tiny corpus a caption listing four items carries too little of the target class to poison with
        pool = [pool[i] for i in rng.permutation(len(pool))]
        pool.sort(key=lambda i: sum(mentions(pairs.captions[i], c) for c in pairs.class_names))
        chosen = np.asarray(pool[:n_captions])
        new_images.append(targets.images[t : t + 1].expand(n_captions, -1, -1, -1))
        new_caps += [pairs.captions[i] for i in chosen]
        new_sig.append(pairs.sig[torch.as_tensor(chosen)])
    n_new = n_targets * n_captions
    first_id = int(pairs.image_id.max()) + 1
    image_id = first_id + torch.arange(n_targets).repeat_interleave(n_captions)
    out = PairSet(
        images=torch.cat([pairs.images, *new_images]),
        captions=pairs.captions + new_caps,
        kind=torch.cat([pairs.kind, torch.full((n_new,), TARGETED)]),
        sig=torch.cat([pairs.sig, *new_sig]),
        image_id=torch.cat([pairs.image_id, image_id]),
        class_names=pairs.class_names,
    )
    return out, TargetSet(targets.images, targets.labels, target_cls)


TRIGGERS = ("badnets", "badnets_random", "blended", "sig", "wanet")


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


def add_backdoor(
    pairs: PairSet,
    n_poison: int,
    target_class: int,
    trigger: str,
    seed: int,
    signatures: SignatureIndex,
    patch: int = 8,
    **params,
) -> PairSet:
    """Trigger ``n_poison`` clean training pairs in place and caption them "a photo of a {target}".

    ``trigger`` is one of :data:`TRIGGERS`; ``params`` further :class:`TriggerParams` fields.
    Returns a new PairSet (same length); the chosen rows get kind = backdoor.
    """
    rng = np.random.default_rng(seed)
    clean = torch.nonzero(pairs.kind == 0).flatten().numpy()
    if n_poison > len(clean):
        raise ValueError(f"n_poison={n_poison} exceeds the {len(clean)} clean pairs")
    rows = torch.as_tensor(np.sort(rng.choice(clean, size=n_poison, replace=False)))
    images, captions = pairs.images.clone(), list(pairs.captions)
    kind, sig = pairs.kind.clone(), pairs.sig.clone()
    images[rows] = apply_trigger(images[rows], trigger, seed, patch, **params)
    name = pairs.class_names[target_class]
    for r in rows.tolist():
        captions[r] = PROMPTS[rng.integers(len(PROMPTS))].format(name)
    kind[rows] = BACKDOOR
    sig[rows] = signatures(frozenset({(target_class, -1, "")}))
    return PairSet(images, captions, kind, sig, pairs.image_id.clone(), pairs.class_names)


def add_wanet_noise(
    pairs: PairSet,
    n_noise: int,
    seed: int,
    trigger_seed: int,
    wanet_grid: int = 4,
    wanet_strength: float = 3.0,
    noise_px: float = 0.5,
) -> tuple[PairSet, torch.Tensor]:
    """WaNet's noise mode [Nguyen & Tran, ICLR 2021; ``VinAIResearch/Warping-based_Backdoor_Attack-release``,
    ``train.py``, its "cross" samples]: ``n_noise`` clean pairs get the trigger warp plus per-pixel uniform
    noise in ``[-noise_px, noise_px]`` px on each axis (a field of their own) and KEEP their true captions, so
    the model must learn the exact trigger warp rather than any warp.

    WaNet adds ``noise / H`` in grid units (about +-0.5 px) and draws fresh cross samples in every batch
    (``cross_ratio`` = 2 per backdoored sample). Ours: a fixed set of noised pairs chosen once, in place of
    clean pairs (like our backdoor pairs; rows from ``seed``, noise from ``seed + 1``), never a backdoor pair;
    they stay ``kind`` clean since their captions are true. ``trigger_seed`` is the backdoor's trigger seed.

    Returns the new PairSet (same length) and the sorted noise-mode rows.
    """
    rng = np.random.default_rng(seed)
    clean = torch.nonzero(pairs.kind == 0).flatten().numpy()
    if n_noise > len(clean):
        raise ValueError(f"n_noise={n_noise} exceeds the {len(clean)} clean pairs")
    rows = torch.as_tensor(np.sort(rng.choice(clean, size=n_noise, replace=False)), dtype=torch.long)
    _, _, h, w = pairs.images.shape
    base = wanet_field((h, w), trigger_seed, wanet_grid, wanet_strength)
    g = torch.Generator().manual_seed(seed + 1)
    images = pairs.images.clone()
    for r in rows.tolist():
        noise = (torch.rand(2, h, w, generator=g) * 2 - 1) * noise_px
        warped = warp(images[r : r + 1].float(), base + noise)
        images[r] = warped.round().clamp(0, 255).to(torch.uint8)[0]
    out = PairSet(
        images,
        list(pairs.captions),
        pairs.kind.clone(),
        pairs.sig.clone(),
        pairs.image_id.clone(),
        pairs.class_names,
    )
    return out, rows
