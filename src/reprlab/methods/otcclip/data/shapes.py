"""Generated shapes testbed [ours; generated data, reports must say so]: 28x28 items of six shape classes
(drawn with random size, offset and stroke), composed into the same 2x2 mosaics and captions as the
Fashion-MNIST testbed (``mosaic.make_mosaics`` with ``class_names=SHAPES``), usually tinted so captions
also name colours ("a red circle at the top left and a blue cross in the bottom right").
"""

from __future__ import annotations

import numpy as np

SHAPES = ("circle", "square", "triangle", "cross", "ring", "bar")


def make_shape_items(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` shape images ``uint8 (n, 28, 28)`` and labels ``(n,)`` (index into :data:`SHAPES`), balanced."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:28, 0:28].astype(np.float32)
    labels = np.arange(n) % len(SHAPES)
    rng.shuffle(labels)
    out = np.zeros((n, 28, 28), np.uint8)
    for i, c in enumerate(labels):
        r = rng.uniform(6, 11)
        cy, cx = 14 + rng.uniform(-2, 2), 14 + rng.uniform(-2, 2)
        dy, dx = yy - cy, xx - cx
        w = rng.uniform(2, 4)
        name = SHAPES[c]
        if name == "circle":
            m = dy**2 + dx**2 <= r**2
        elif name == "square":
            m = (np.abs(dy) <= r * 0.8) & (np.abs(dx) <= r * 0.8)
        elif name == "triangle":
            m = (dy <= r * 0.7) & (dy >= -r) & (np.abs(dx) <= (dy + r) * 0.6)
        elif name == "cross":
            m = ((np.abs(dy) <= w / 2) & (np.abs(dx) <= r)) | ((np.abs(dx) <= w / 2) & (np.abs(dy) <= r))
        elif name == "ring":
            d = np.sqrt(dy**2 + dx**2)
            m = (d <= r) & (d >= r - w)
        else:  # bar
            m = (np.abs(dy) <= w / 2 + 1) & (np.abs(dx) <= r)
        out[i][m] = int(rng.integers(170, 256))
    return out, labels.astype(np.int64)
