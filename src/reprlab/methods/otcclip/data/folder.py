"""An ImageFolder (one sub-folder per class, as torchvision's) of the user's own images [ours]: the index of its
files and labels, its class names, and its images decoded at a model's input size.

Class names come from the folder names (``_`` read as a space: ``ankle_boot`` -> ``ankle boot``) or from a JSON
file: a list in sorted folder order, or an object mapping every folder name to its class name (ImageNet's
``n01440764`` -> ``tench``). Images are opened through :func:`reprlab.io.untrusted.open_image_bounded` (a pixel
limit before decoding; a corrupt file is an error naming it) and fitted as training fits them (shorter side
resized bicubically, centre crop: :func:`..transforms.fit_image`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from reprlab.errors import DataError, DataFileMissingError
from reprlab.io.untrusted import open_image_bounded
from reprlab.methods.otcclip.data.datasets import IMAGE_EXT
from reprlab.methods.otcclip.data.transforms import fit_image, to_uint8
from reprlab.train.progress import progress


@dataclass(frozen=True)
class ImageFolder:
    """``paths`` of the images, ``labels int64 (N,)`` indexing ``class_names`` (one per class folder, in sorted
    folder order)."""

    root: Path
    paths: tuple[Path, ...]
    labels: np.ndarray
    class_names: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.paths)


def class_names_for(folders: list[str], spec: str | Path = "", where: str = "") -> tuple[str, ...]:
    """Class names of ``folders`` (sorted folder names): from the names, or from the JSON file ``spec``.

    Raises:
        DataFileMissingError, DataError: a missing or malformed JSON, or one that does not cover every folder.
    """
    if not str(spec):
        return tuple(f.replace("_", " ") for f in folders)
    path = Path(spec)
    if not path.is_file():
        raise DataFileMissingError(f"class-name file {path} does not exist")
    try:
        names = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise DataError(f"{path}: not a readable JSON file of class names ({err})") from None
    if isinstance(names, list):
        if len(names) != len(folders):
            raise DataError(
                f"{path}: {len(names)} class names for the {len(folders)} class folders of {where or 'the folder'}"
            )
        return tuple(str(n) for n in names)
    if isinstance(names, dict):
        missing = [f for f in folders if f not in names]
        if missing:
            raise DataError(f"{path}: no class name for the folders {missing[:5]} of {where or 'the folder'}")
        return tuple(str(names[f]) for f in folders)
    raise DataError(f"{path}: expected a JSON list of class names or an object folder -> class name")


def image_folder(
    root: str | Path, class_names: str | Path = "", max_per_class: int = 0, seed: int = 0, key: str = ""
) -> ImageFolder:
    """Index an ImageFolder: every image file (``IMAGE_EXT``) under each class folder, sorted by path; with
    ``max_per_class`` a seeded random subset of at most that many per class. ``key`` names the setting in errors.

    Raises:
        DataFileMissingError: no such folder. DataError: no class folder, or no image in any of them.
    """
    root = Path(root)
    what = f"{key}: " if key else ""
    if not root.is_dir():
        raise DataFileMissingError(
            f"{what}ImageFolder {root} does not exist",
            hint="give a folder with one sub-folder of images per class (torchvision's ImageFolder layout)",
        )
    folders = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not folders:
        raise DataError(f"{what}{root} has no class folders (expected one sub-folder of images per class)")
    names = class_names_for(folders, class_names, str(root))
    rng = np.random.default_rng([seed, 77])
    paths: list[Path] = []
    labels: list[int] = []
    for c, folder in enumerate(folders):
        files = sorted(p for p in (root / folder).rglob("*") if p.suffix.lower() in IMAGE_EXT and p.is_file())
        if max_per_class and len(files) > max_per_class:
            files = [files[i] for i in sorted(rng.choice(len(files), max_per_class, replace=False))]
        paths += files
        labels += [c] * len(files)
    if (
        not paths
    ):  # an empty class folder is a class with no image (still a zero-shot candidate); all empty is not
        raise DataError(f"{what}{root}: its class folders hold no image ({', '.join(IMAGE_EXT)})")
    return ImageFolder(root, tuple(paths), np.asarray(labels, dtype=np.int64), names)


def load_image(path: str | Path | bytes, size: int, channels: int, name: str | None = None) -> torch.Tensor:
    """One image, decoded with a pixel limit and fitted to ``uint8 (channels, size, size)``.

    Raises:
        DataError: naming the file (corrupt, truncated, over the pixel limit); DataFileMissingError.
    """
    im = open_image_bounded(path, name=name, mode="L" if channels == 1 else "RGB")
    return to_uint8(fit_image(im, size))


def load_images(paths, size: int, channels: int, desc: str = "images") -> torch.Tensor:
    """``uint8 (N, channels, size, size)`` of ``paths`` (a progress bar over the files)."""
    if not len(paths):
        return torch.zeros(0, channels, size, size, dtype=torch.uint8)
    return torch.stack([load_image(p, size, channels) for p in progress(paths, total=len(paths), desc=desc)])
