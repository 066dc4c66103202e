"""Targeted data poisoning and backdoors, following the RoCLIP / CleanCLIP protocols.

* Targeted [RoCLIP, ``model/create_poison.ipynb``]: each of T held-out target images (never used in
  training or evaluation) gets a wrong target class y_t and is paired with N real training captions that
  mention y_t as a whole word. ASR_targeted: share of targets whose zero-shot class is y_t.
* Backdoor [CleanCLIP, ``backdoor/utils.py``]: M training images get a trigger (:mod:`.triggers`) and a "a
  photo of a {target}" caption. ASR_backdoor: share of triggered test images of true class != target
  classified as the target; evaluation applies the same trigger (same seed) to test images.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch

from reprlab.methods.otcclip.data.mosaic import PROMPTS, make_single_items
from reprlab.methods.otcclip.data.pairs import BACKDOOR, TARGETED, PairSet, SignatureIndex
from reprlab.methods.otcclip.data.triggers import apply_trigger, wanet_field, warp


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
    render=None,
) -> tuple[PairSet, TargetSet]:
    """Append ``n_targets * n_captions`` targeted-poison pairs.

    Args:
        pairs: clean training pairs (their captions are the pool poison captions are drawn from).
        x, y: held-out item images ``uint8 (M, 28, 28)`` and labels the targets are drawn from.
        n_targets: T; n_captions: N captions per target.
        render: ``(x, y, seed) -> LabeledSet`` drawing the target images; default a mosaic quadrant
            (:func:`~.mosaic.make_single_items`).

    Raises:
        ValueError: fewer than N training captions mention a chosen target class.
    """
    rng = np.random.default_rng(seed)
    n_classes = len(pairs.class_names)
    picks = rng.choice(len(x), size=n_targets, replace=False)
    if render is None:
        targets = make_single_items(x[picks], y[picks], seed=seed + 1, tint=tint)
    else:
        targets = render(x[picks], y[picks], seed + 1)
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
        chosen = np.asarray(pool[:n_captions], dtype=np.int64)
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
