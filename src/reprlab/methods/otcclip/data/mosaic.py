"""Fashion-MNIST mosaic testbed: real item images composed into 2x2 scenes with compositional captions [ours].

No captioned images exist offline (``docs/assets.md``), so we build them: each training image is a
56x56 grid whose four 28x28 quadrants hold 1-4 Fashion-MNIST items (optionally tinted), captioned from
varied templates naming each item and where it is ("a photo of a sneaker at the top left and a bag in
the bottom right"). Patch-token OT alignment therefore carries meaning: the patches of a quadrant should
match the tokens that name its item and position. Single items (one quadrant filled) with class prompts
serve zero-shot, linear-probe and ASR evaluation. Everything is deterministic from the seed.
"""

from __future__ import annotations

import numpy as np
import torch

from reprlab.assets import FASHION_MNIST_CLASSES, fashion_mnist
from reprlab.methods.otcclip.data.pairs import LabeledSet, PairSet, SignatureIndex

POSITIONS = ("top left", "top right", "bottom left", "bottom right")
PREFIXES = ("", "a photo of ", "a picture of ", "an image of ")
# "" gives the terse form "a bag top left"; short captions keep the text encoder cheap on CPU
PLACES = ("", "at the", "in the", "on the")
JOINERS = (" and ", ", ", " with ")
# zero-shot prompt ensemble; every word also occurs in training captions, so the tokenizer knows it
PROMPTS = ("a photo of a {}", "a picture of a {}", "an image of a {}", "a {}")
TINTS = {
    "red": (1.0, 0.3, 0.3),
    "green": (0.3, 1.0, 0.3),
    "blue": (0.35, 0.45, 1.0),
    "yellow": (1.0, 1.0, 0.3),
}


def caption_for(
    items: list[tuple[int, int, str]], rng: np.random.Generator, classes=FASHION_MNIST_CLASSES
) -> str:
    """Compositional caption for ``(class, position, tint-word)`` items, in random order and template."""
    order = rng.permutation(len(items))
    place = PLACES[rng.integers(len(PLACES))]
    phrases = []
    for i in order:
        cls, pos, tint = items[i]
        name = f"{tint} {classes[cls]}" if tint else classes[cls]
        phrases.append(" ".join(w for w in ("a", name, place, POSITIONS[pos]) if w))
    return PREFIXES[rng.integers(len(PREFIXES))] + JOINERS[rng.integers(len(JOINERS))].join(phrases)


def _paint(canvas: np.ndarray, item: np.ndarray, pos: int, tint: str) -> None:
    r, c = divmod(pos, 2)
    patch = item.astype(np.float32)
    if canvas.shape[0] == 3:
        patch = patch[None] * np.asarray(TINTS[tint] if tint else (1.0, 1.0, 1.0), np.float32)[:, None, None]
    canvas[:, r * 28 : (r + 1) * 28, c * 28 : (c + 1) * 28] = patch


def make_mosaics(
    n_pairs: int,
    seed: int,
    min_items: int = 1,
    max_items: int = 4,
    tint: bool = False,
    source: tuple[np.ndarray, np.ndarray] | None = None,
    signatures: SignatureIndex | None = None,
    class_names: tuple[str, ...] = FASHION_MNIST_CLASSES,
) -> PairSet:
    """Build ``n_pairs`` clean mosaic pairs from Fashion-MNIST train items.

    Args:
        n_pairs: number of pairs.
        seed: makes images and captions deterministic.
        min_items, max_items: items per mosaic, drawn uniformly in ``[min_items, max_items]`` (<= 4).
        tint: colour each item and name the colour in the caption (3 channels instead of 1).
        source: ``(images uint8 (M, 28, 28), labels (M,))``; defaults to the Fashion-MNIST train split.
        signatures: shared interner so that poisons built later get comparable ``sig`` ids.
        class_names: names of the ``source`` labels (captions use them).
    """
    if not 1 <= min_items <= max_items <= 4:
        raise ValueError(f"need 1 <= min_items <= max_items <= 4, got {min_items}, {max_items}")
    if n_pairs < 1:
        raise ValueError(f"n_pairs must be >= 1, got {n_pairs}")
    x, y = source if source is not None else fashion_mnist("train")
    rng = np.random.default_rng(seed)
    sigs = signatures or SignatureIndex()
    channels = 3 if tint else 1
    images = np.zeros((n_pairs, channels, 56, 56), np.float32)
    captions, sig = [], []
    tint_names = list(TINTS)
    for n in range(n_pairs):
        k = int(rng.integers(min_items, max_items + 1))
        positions = rng.choice(4, size=k, replace=False)
        picks = rng.integers(len(x), size=k)
        items = []
        for pos, pick in zip(positions.tolist(), picks.tolist()):
            t = tint_names[rng.integers(len(tint_names))] if tint else ""
            _paint(images[n], x[pick], pos, t)
            items.append((int(y[pick]), pos, t))
        captions.append(caption_for(items, rng, class_names))
        sig.append(sigs(frozenset(items)))
    return PairSet(
        images=torch.from_numpy(images.clip(0, 255).astype(np.uint8)),
        captions=captions,
        kind=torch.zeros(n_pairs, dtype=torch.long),
        sig=torch.tensor(sig),
        image_id=torch.arange(n_pairs),
        class_names=tuple(class_names),
    )


def make_single_items(x: np.ndarray, y: np.ndarray, seed: int, tint: bool = False) -> LabeledSet:
    """Single items, each in a random quadrant of an empty mosaic (in distribution: mosaics hold 1-4 items).

    Args:
        x: ``uint8 (N, 28, 28)`` item images; y: ``(N,)`` labels.
    """
    rng = np.random.default_rng(seed)
    channels = 3 if tint else 1
    images = np.zeros((len(x), channels, 56, 56), np.float32)
    tint_names = list(TINTS)
    for n in range(len(x)):
        t = tint_names[rng.integers(len(tint_names))] if tint else ""
        _paint(images[n], x[n], int(rng.integers(4)), t)
    return LabeledSet(
        torch.from_numpy(images.clip(0, 255).astype(np.uint8)), torch.as_tensor(y, dtype=torch.long)
    )


def class_prompts(classes=FASHION_MNIST_CLASSES, templates=PROMPTS) -> list[list[str]]:
    """``[class][template]`` prompt strings for the zero-shot ensemble."""
    return [[t.format(c) for t in templates] for c in classes]
