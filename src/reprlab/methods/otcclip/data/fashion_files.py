"""Fashion-MNIST as a user's files [ours]: the packaged items written as PNG files the way a user's data arrives,
for ``otcclip-folder-tiny`` and the end-to-end tests of ``reprlab otcclip poison`` and the folder evaluation.

Real images, plain layouts: ``train/{i}.png`` with ``captions.csv`` (image, caption: one of our caption
templates with the item's class, [ours]); ``probe_train/<class>/`` (other train items, for the linear probe);
``test/<class>/`` (test items: zero-shot, probe test, backdoor ASR) and ``targets/<class>/`` (other test items:
the pool the targeted poisons' targets are picked from, never trained on nor evaluated); ``templates.txt`` (the
caption templates, as zero-shot prompts). Class folders are the class names with ``_`` for a space.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from reprlab.assets import FASHION_MNIST_CLASSES, fashion_mnist
from reprlab.methods.otcclip.data.mosaic import PROMPTS


def _png(path: Path, image: np.ndarray) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(image).save(path, format="PNG")


def folder_name(cls: str) -> str:
    return cls.replace(" ", "_")


def write_fashion_files(
    out: str | Path, n_train: int, n_probe_train: int, n_test: int, n_target_pool: int, seed: int = 0
) -> dict[str, str]:
    """Write the layout above into ``out`` (train items disjoint from probe items, test items disjoint from the
    target pool; each a seeded random subset); returns the paths by role."""
    out = Path(out)
    rng = np.random.default_rng([seed, 31])
    xtr, ytr = fashion_mnist("train")
    xte, yte = fashion_mnist("test")
    tr = rng.permutation(len(xtr))[: n_train + n_probe_train]
    te = rng.permutation(len(xte))[: n_test + n_target_pool]
    rows = []
    for i in tr[:n_train]:
        name = f"train/{int(i):05d}.png"
        _png(out / name, xtr[i])
        cls = FASHION_MNIST_CLASSES[int(ytr[i])]
        rows.append((name, PROMPTS[int(rng.integers(len(PROMPTS)))].format(cls)))
    with open(out / "captions.csv", "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(["image", "caption"])
        w.writerows(rows)
    for role, x, y, idx in (
        ("probe_train", xtr, ytr, tr[n_train:]),
        ("test", xte, yte, te[:n_test]),
        ("targets", xte, yte, te[n_test:]),
    ):
        for c in FASHION_MNIST_CLASSES:  # every class folder exists, even when a small subset misses a class
            (out / role / folder_name(c)).mkdir(parents=True, exist_ok=True)
        for i in idx:
            _png(out / role / folder_name(FASHION_MNIST_CLASSES[int(y[i])]) / f"{int(i):05d}.png", x[i])
    (out / "templates.txt").write_text("".join(t + "\n" for t in PROMPTS), encoding="utf-8")
    roles = ("captions.csv", "probe_train", "test", "targets", "templates.txt")
    return {r.split(".")[0]: str(out / r) for r in roles}
