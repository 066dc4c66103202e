"""A planted poisoning problem whose answers are known by construction, and an oracle CLIP for it.

Data: 16 pairs, one global batch. 12 clean pairs, 3 per class (cat, dog, bag, hat); an image of class c is a
flat 8x8 grey image of level 40 + 50 c. 4 targeted poisons: images of class 0 (cat) captioned as dogs.

Oracle model: an image's global feature and each of its 4 patches is e_c (one-hot of its class); a caption's
global feature and each of its word tokens is e_c of the class word it contains. So cos(image, caption) is 1
for a matching class and 0 otherwise, the OT distance (1 - cos cost, constant matrix) is 0 or 1, and every
defense decision below has a known right answer. Only ``logit_scale`` is trained (the loss needs a graph).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from reprlab.methods.otcclip.config import TrainConfig
from reprlab.methods.otcclip.data.pairs import CLEAN, TARGETED, PairSet
from reprlab.methods.otcclip.data.tokenizer import WordTokenizer
from reprlab.methods.otcclip.models.features import ImageFeatures, TextFeatures

CLASSES = ("cat", "dog", "bag", "hat")
ADJ = ("small", "grey", "plain")
DIM = 8
N_PATCHES = 4
# no augmentation and no word dropout: the oracle reads classes from exact pixel levels and words
TRAIN = TrainConfig(epochs=3, batch_size=16, warmup_steps=1, shift=0, brightness=0.0, word_dropout=0.0)


def planted_pairs() -> PairSet:
    """12 clean pairs (rows 0-11, class = row // 3) then 4 cat images captioned as dogs (rows 12-15)."""
    img_cls = [r // 3 for r in range(12)] + [0] * 4
    txt_cls = [r // 3 for r in range(12)] + [1] * 4
    caps = [f"a {ADJ[r % 3]} photo of a {CLASSES[c]}" for r, c in enumerate(txt_cls)]
    images = torch.stack([torch.full((1, 8, 8), 40 + 50 * c, dtype=torch.uint8) for c in img_cls])
    kind = torch.tensor([CLEAN] * 12 + [TARGETED] * 4)
    sig = torch.tensor(txt_cls)  # caption content = its class
    return PairSet(images, caps, kind, sig, torch.arange(16), class_names=CLASSES)


def image_class(pairs: PairSet) -> torch.Tensor:
    """True content class of each image (the oracle's reading of the pixel level)."""
    return ((pairs.images.float().mean((1, 2, 3)) - 40) / 50).round().long()


class PlantedCLIP(torch.nn.Module):
    """Oracle features (see module docstring); ``record`` keeps the features of every call."""

    def __init__(self, tok: WordTokenizer):
        super().__init__()
        self.cfg = type("Cfg", (), {"max_len": 8, "embed_dim": DIM})()
        self.word_class = {tok.index[c]: k for k, c in enumerate(CLASSES)}
        self.logit_scale = torch.nn.Parameter(torch.tensor(math.log(10.0)))
        self.unused = torch.nn.Parameter(torch.zeros(1, 1))  # gives AdamW's decay group a member

    def scale(self) -> torch.Tensor:
        return self.logit_scale.exp()

    def encode_image(self, x: torch.Tensor) -> ImageFeatures:
        pix = (x + 1) * 127.5
        k = ((pix.mean((1, 2, 3)) - 40) / 50).round().long().clamp(0, len(CLASSES) - 1)
        g = F.one_hot(k, DIM).float()
        return ImageFeatures(
            g, g[:, None].expand(-1, N_PATCHES, -1), torch.ones(len(x), N_PATCHES, dtype=torch.bool)
        )

    def encode_text(self, ids: torch.Tensor, mask: torch.Tensor) -> TextFeatures:
        k = torch.full((len(ids),), DIM - 1)
        for wid, c in self.word_class.items():
            k = torch.where((ids == wid).any(1), torch.full_like(k, c), k)
        g = F.one_hot(k, DIM).float()
        return TextFeatures(g, g[:, None].expand(-1, ids.shape[1], -1) * mask[..., None], mask)


def symmetric_infonce(u: torch.Tensor, w: torch.Tensor, scale: float) -> float:
    """The CLIP loss written out independently of the library: mean of row and column cross-entropies."""
    logits = scale * u.double() @ w.double().T
    n = len(logits)
    rows = -sum(logits[i, i] - torch.logsumexp(logits[i], 0) for i in range(n)) / n
    cols = -sum(logits[i, i] - torch.logsumexp(logits[:, i], 0) for i in range(n)) / n
    return float(0.5 * (rows + cols))
