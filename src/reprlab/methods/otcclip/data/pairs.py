"""The data types every part of the package passes around: image-caption pairs with provenance, labelled
single-item sets, and the scene-content interner that gives captions comparable ``sig`` ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from reprlab.assets import FASHION_MNIST_CLASSES

CLEAN, TARGETED, BACKDOOR = 0, 1, 2


@dataclass
class PairSet:
    """Image-caption training pairs with provenance.

    Attributes:
        images: ``uint8 (N, C, H, W)``.
        captions: N captions.
        kind: ``int64 (N,)``: 0 clean, 1 targeted poison, 2 backdoor poison.
        sig: ``int64 (N,)``: id of the caption's content (set of (item, position)); two captions with
            the same id describe the same scene, which is how re-matching quality counts a kept caption.
        image_id: ``int64 (N,)``: source image id (targeted poisons repeat one image many times).
    """

    images: torch.Tensor
    captions: list[str]
    kind: torch.Tensor
    sig: torch.Tensor
    image_id: torch.Tensor
    class_names: tuple[str, ...] = FASHION_MNIST_CLASSES
    skipped: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.captions)

    def select(self, rows: torch.Tensor) -> PairSet:
        """The pairs at ``rows`` (``bool (N,)`` or indices), provenance kept."""
        index = torch.nonzero(rows).flatten() if rows.dtype == torch.bool else rows
        return PairSet(
            self.images[index],
            [self.captions[i] for i in index.tolist()],
            self.kind[index],
            self.sig[index],
            self.image_id[index],
            self.class_names,
            dict(self.skipped),
        )

    def __post_init__(self):
        n = len(self.captions)
        if n == 0:
            raise ValueError("PairSet is empty: no valid image-caption pairs")
        for name in ("images", "kind", "sig", "image_id"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"PairSet.{name} has {len(getattr(self, name))} rows, captions {n}")


@dataclass
class LabeledSet:
    """Single-item images with class labels: ``images uint8 (N, C, H, W)``, ``labels int64 (N,)``."""

    images: torch.Tensor
    labels: torch.Tensor


class SignatureIndex:
    """Interns scene contents (frozensets) to stable int ids."""

    def __init__(self):
        self.ids: dict[frozenset, int] = {}

    def __call__(self, content: frozenset) -> int:
        return self.ids.setdefault(content, len(self.ids))
