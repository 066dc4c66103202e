"""Targeted data poisoning and backdoor triggers, following the RoCLIP / CleanCLIP protocols.

* Targeted [RoCLIP, ``model/create_poison.ipynb``]: each of T held-out target images (never used in
  training or evaluation) gets a wrong target class y_t and is paired with N real training captions that
  mention y_t as a whole word. ASR_targeted: share of targets whose zero-shot class is y_t.
* Backdoor [CleanCLIP, ``backdoor/utils.py``]: M training images get a trigger and a "a photo of a
  {target}" caption. BadNets pastes a fixed noise patch (CleanCLIP: 16x16 on 224 px; ours: 8x8 on
  56 px, same share of the side); blended mixes x' = 0.8 x + 0.2 noise. ASR_backdoor: share of triggered
  test images of true class != target classified as the target.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch

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


def trigger_pattern(kind: str, shape: tuple[int, int, int], seed: int, patch: int = 8) -> torch.Tensor:
    """Deterministic trigger pattern ``float (C, H, W)`` in [0, 255] (BadNets: only the patch is used)."""
    g = torch.Generator().manual_seed(seed)
    c, h, w = shape
    if kind == "badnets":
        # binary noise patch, same in every channel so it survives greyscale
        return (torch.rand(1, patch, patch, generator=g) > 0.5).float().expand(c, -1, -1) * 255.0
    if kind == "blended":
        return torch.rand(1, h, w, generator=g).expand(c, -1, -1) * 255.0
    raise ValueError(f"unknown trigger {kind!r}; choose 'badnets' or 'blended'")


def apply_trigger(
    images: torch.Tensor, kind: str, seed: int, patch: int = 8, alpha: float = 0.2
) -> torch.Tensor:
    """Add the trigger to ``uint8 (N, C, H, W)`` images.

    BadNets: the patch at the bottom-right corner [ours: a fixed corner; CleanCLIP also draws random
    locations, which a tiny model trained for minutes learns far less reliably]. Blended: ``(1 - alpha) x
    + alpha noise`` with alpha = 0.2 as in CleanCLIP.
    """
    pattern = trigger_pattern(kind, tuple(images.shape[1:]), seed, patch)
    out = images.float()
    if kind == "badnets":
        out[:, :, -patch:, -patch:] = pattern
    else:
        out = (1 - alpha) * out + alpha * pattern
    return out.round().clamp(0, 255).to(torch.uint8)


def add_backdoor(
    pairs: PairSet,
    n_poison: int,
    target_class: int,
    trigger: str,
    seed: int,
    signatures: SignatureIndex,
    patch: int = 8,
) -> PairSet:
    """Trigger ``n_poison`` clean training pairs in place and caption them "a photo of a {target}".

    Returns a new PairSet (same length); the chosen rows get kind = backdoor.
    """
    rng = np.random.default_rng(seed)
    clean = torch.nonzero(pairs.kind == 0).flatten().numpy()
    if n_poison > len(clean):
        raise ValueError(f"n_poison={n_poison} exceeds the {len(clean)} clean pairs")
    rows = torch.as_tensor(np.sort(rng.choice(clean, size=n_poison, replace=False)))
    images, captions = pairs.images.clone(), list(pairs.captions)
    kind, sig = pairs.kind.clone(), pairs.sig.clone()
    images[rows] = apply_trigger(images[rows], trigger, seed, patch)
    name = pairs.class_names[target_class]
    for r in rows.tolist():
        captions[r] = PROMPTS[rng.integers(len(PROMPTS))].format(name)
    kind[rows] = BACKDOOR
    sig[rows] = signatures(frozenset({(target_class, -1, "")}))
    return PairSet(images, captions, kind, sig, pairs.image_id.clone(), pairs.class_names)
