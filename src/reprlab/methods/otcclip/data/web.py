"""Web-like Fashion-MNIST pairs [ours]: many images per concept, paraphrased captions with attributes read from
the image, and alt-text noise.

Why: the re-matching defenses (RoCLIP, OTCCLIP) assume that for most images some *other* caption in a small bank
describes the same concept, as on web data, where thousands of images show "a dog on a beach". The mosaic testbed
(:mod:`.mosaic`) composes scenes that almost never repeat, so a nearest-neighbour caption seldom describes the
image's scene (its concept-match rate, ``docs/otcclip_testbed.md``), and RoCLIP-style loses accuracy there while
its paper reports none. Here each image is one real Fashion-MNIST item (the concept is its class) drawn on a
56x56 canvas with cheap per-image variation: scale, placement, brightness and background noise. Its caption is a
template x a name (the class name or a synonym) x some of the attributes the image really has (small/large,
dark/light, on the left/right), e.g. "buy this small dark sneaker on the left online". A declared share of
captions is alt-text noise: generic ("product photo") or describing another class, as web alt-text is.

Everything is deterministic from the seed. Single items for zero-shot, probe and targeted-poison targets are
drawn by the same renderer (:func:`render_items`), so evaluation is in distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from reprlab.assets import FASHION_MNIST_CLASSES
from reprlab.methods.otcclip.data.pairs import LabeledSet, PairSet, SignatureIndex

CANVAS = 56
# [ours] item side in px: below SMALL_MAX reads "small", above LARGE_MIN "large", between no size word
MIN_SIDE, MAX_SIDE, SMALL_MAX, LARGE_MIN = 26, 44, 31, 39
# brightness factor: below DARK_MAX reads "dark", above LIGHT_MIN "light"
MIN_BRIGHT, DARK_MAX, LIGHT_MIN = 0.5, 0.65, 0.9
NOISE_MAX = 12.0  # largest background-noise amplitude (sd, grey levels of 255)

# [ours] synonyms never contain another class name as a whole word (data.poison.mentions): "handbag" is not "bag"
SYNONYMS = {
    "t-shirt": ("tee", "short sleeve top"),
    "trouser": ("pants", "slacks"),
    "pullover": ("sweater", "jumper"),
    "dress": ("gown", "frock"),
    "coat": ("jacket", "overcoat"),
    "sandal": ("slipper", "strappy heel"),
    "shirt": ("blouse", "button-down"),
    "sneaker": ("trainer", "running shoe"),
    "bag": ("handbag", "purse"),
    "ankle boot": ("bootie", "chelsea boot"),
}
NAME_SHARE = 0.6  # share of captions that use the class name (the rest a synonym)
TEMPLATES = (
    "a photo of a {}",
    "a picture of the {}",
    "an image of a {}",
    "{} for sale",
    "buy this {} online",
    "my new {}",
    "close-up of a {}",
    "{}",
)
GENERIC = (
    "image",
    "product photo",
    "click to enlarge",
    "new arrivals this week",
    "best price",
    "untitled",
    "photo",
    "view details",
)
GENERIC_SIG = frozenset({(-1, -3, "generic")})


@dataclass
class Rendered:
    """Rendered items: ``images uint8 (N, 1, 56, 56)`` and their attribute words (``""`` = none) per item."""

    images: torch.Tensor
    size: list[str]
    tone: list[str]
    side: list[str]


def render_items(x: np.ndarray, seed: int) -> Rendered:
    """Draw each ``uint8 (N, 28, 28)`` item once on a 56x56 canvas with random scale, placement, brightness
    and background noise (deterministic from ``seed``); returns the images and their attribute words."""
    rng = np.random.default_rng(seed)
    n = len(x)
    sides = rng.integers(MIN_SIDE, MAX_SIDE + 1, size=n)
    bright = rng.uniform(MIN_BRIGHT, 1.0, size=n)
    noise_sd = rng.uniform(0.0, NOISE_MAX, size=n)
    tops = rng.integers(0, CANVAS - sides + 1)
    lefts = rng.integers(0, CANVAS - sides + 1)
    out = np.zeros((n, 1, CANVAS, CANVAS), np.float32)
    items = torch.from_numpy(np.asarray(x, np.float32))[:, None]
    for s in np.unique(sides):
        rows = np.nonzero(sides == s)[0]
        scaled = F.interpolate(
            items[rows], size=(int(s), int(s)), mode="bilinear", align_corners=False
        ).numpy()
        for j, r in enumerate(rows):
            out[r, 0, tops[r] : tops[r] + s, lefts[r] : lefts[r] + s] = scaled[j, 0]
    out *= bright[:, None, None, None].astype(np.float32)
    out += (rng.standard_normal(out.shape) * noise_sd[:, None, None, None]).astype(np.float32)
    centre = lefts + sides / 2
    size = ["small" if s <= SMALL_MAX else "large" if s >= LARGE_MIN else "" for s in sides]
    tone = ["dark" if b <= DARK_MAX else "light" if b >= LIGHT_MIN else "" for b in bright]
    # [ours] "left"/"right" only when the item's centre is in the outer third of the canvas
    side = ["on the left" if c < CANVAS / 3 else "on the right" if c > 2 * CANVAS / 3 else "" for c in centre]
    images = torch.from_numpy(np.rint(out).clip(0, 255).astype(np.uint8))
    return Rendered(images, size, tone, side)


def web_caption(cls: int, size: str, tone: str, side: str, rng: np.random.Generator, classes) -> str:
    """One paraphrase of item class ``cls``: template x name (class name or synonym) x a random subset of the
    attribute words the image has (each named with probability 1/2)."""
    name = classes[cls]
    syn = SYNONYMS.get(name, ())
    if syn and rng.random() >= NAME_SHARE:
        name = syn[rng.integers(len(syn))]
    adj = [w for w in (size, tone) if w and rng.random() < 0.5]
    desc = " ".join([*adj, name])
    if side and rng.random() < 0.5:
        desc = f"{desc} {side}"
    return TEMPLATES[rng.integers(len(TEMPLATES))].format(desc)


@dataclass
class WebPairs:
    """:func:`make_web_pairs`' output: the pairs, each pair's item class ``labels (N,)`` and the sorted rows
    whose caption is alt-text noise (``noisy``), split into ``generic`` and ``wrong`` (another class)."""

    pairs: PairSet
    labels: torch.Tensor
    noisy: torch.Tensor
    n_generic: int
    n_wrong: int


def make_web_pairs(
    n_pairs: int,
    seed: int,
    source: tuple[np.ndarray, np.ndarray],
    noise_share: float = 0.1,
    wrong_share: float = 0.5,
    signatures: SignatureIndex | None = None,
    class_names: tuple[str, ...] = FASHION_MNIST_CLASSES,
) -> WebPairs:
    """``n_pairs`` web-like pairs of single items from ``source`` (``uint8 (M, 28, 28)``, labels ``(M,)``).

    ``round(noise_share * n_pairs)`` captions (rows drawn at random) are alt-text noise: ``round(wrong_share *
    n_noisy)`` of them describe a random other class (a caption as the web writes it, so the text is fluent),
    the rest are generic. ``sig`` is the caption's concept: its class (the same id the backdoor's "a photo of a
    {target}" captions get), or one shared id for generic captions.
    """
    if n_pairs < 1:
        raise ValueError(f"n_pairs must be >= 1, got {n_pairs}")
    if not 0.0 <= noise_share <= 1.0 or not 0.0 <= wrong_share <= 1.0:
        raise ValueError(f"noise shares must be in [0, 1], got {noise_share}, {wrong_share}")
    x, y = source
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(x), size=n_pairs, replace=n_pairs > len(x))
    labels = np.asarray(y)[picks].astype(np.int64)
    art = render_items(np.asarray(x)[picks], seed + 1000)
    sigs = signatures or SignatureIndex()
    n_noisy = int(round(noise_share * n_pairs))
    n_wrong = int(round(wrong_share * n_noisy))
    noisy = np.sort(rng.choice(n_pairs, size=n_noisy, replace=False))
    wrong = set(rng.permutation(noisy)[:n_wrong].tolist())
    k = len(class_names)
    captions, sig = [], []
    for r in range(n_pairs):
        cls = int(labels[r])
        if r in wrong:
            other = (cls + int(rng.integers(1, k))) % k
            captions.append(web_caption(other, art.size[r], art.tone[r], art.side[r], rng, class_names))
            sig.append(sigs(frozenset({(other, -1, "")})))
        elif r in noisy:
            captions.append(GENERIC[rng.integers(len(GENERIC))])
            sig.append(sigs(GENERIC_SIG))
        else:
            captions.append(web_caption(cls, art.size[r], art.tone[r], art.side[r], rng, class_names))
            sig.append(sigs(frozenset({(cls, -1, "")})))
    pairs = PairSet(
        images=art.images,
        captions=captions,
        kind=torch.zeros(n_pairs, dtype=torch.long),
        sig=torch.tensor(sig),
        image_id=torch.arange(n_pairs),
        class_names=tuple(class_names),
    )
    return WebPairs(pairs, torch.from_numpy(labels), torch.from_numpy(noisy), n_noisy - n_wrong, n_wrong)


def web_single_items(x: np.ndarray, y: np.ndarray, seed: int) -> LabeledSet:
    """Single items drawn by the training renderer (zero-shot, probe and targeted-poison targets)."""
    return LabeledSet(render_items(x, seed).images, torch.as_tensor(np.asarray(y), dtype=torch.long))
