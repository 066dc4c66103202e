"""Zero-shot prompt templates: CLIP's 80 ImageNet templates, or the user's own file.

``CLIP_IMAGENET_TEMPLATES`` is the ensemble of the CLIP paper [Radford et al., ICML 2021; the public list of its
"Prompt Engineering for ImageNet" notebook], written out here (nothing is fetched). A template file holds one
template per line with ``{}`` where the class name goes; blank lines and lines starting with ``#`` are skipped.
"""

from __future__ import annotations

from pathlib import Path

from reprlab.errors import DataError, DataFileMissingError

CLIP_IMAGENET_TEMPLATES = (
    "a bad photo of a {}.", "a photo of many {}.", "a sculpture of a {}.", "a photo of the hard to see {}.",
    "a low resolution photo of the {}.", "a rendering of a {}.", "graffiti of a {}.", "a bad photo of the {}.",
    "a cropped photo of the {}.", "a tattoo of a {}.", "the embroidered {}.", "a photo of a hard to see {}.",
    "a bright photo of a {}.", "a photo of a clean {}.", "a photo of a dirty {}.", "a dark photo of the {}.",
    "a drawing of a {}.", "a photo of my {}.", "the plastic {}.", "a photo of the cool {}.",
    "a close-up photo of a {}.", "a black and white photo of the {}.", "a painting of the {}.",
    "a painting of a {}.", "a pixelated photo of the {}.", "a sculpture of the {}.", "a bright photo of the {}.",
    "a cropped photo of a {}.", "a plastic {}.", "a photo of the dirty {}.", "a jpeg corrupted photo of a {}.",
    "a blurry photo of the {}.", "a photo of the {}.", "a good photo of the {}.", "a rendering of the {}.",
    "a {} in a video game.", "a photo of one {}.", "a doodle of a {}.", "a close-up photo of the {}.",
    "a photo of a {}.", "the origami {}.", "the {} in a video game.", "a sketch of a {}.", "a doodle of the {}.",
    "a origami {}.", "a low resolution photo of a {}.", "the toy {}.", "a rendition of the {}.",
    "a photo of the clean {}.", "a photo of a large {}.", "a rendition of a {}.", "a photo of a nice {}.",
    "a photo of a weird {}.", "a blurry photo of a {}.", "a cartoon {}.", "art of a {}.", "a sketch of the {}.",
    "a embroidered {}.", "a pixelated photo of a {}.", "itap of the {}.", "a jpeg corrupted photo of the {}.",
    "a good photo of a {}.", "a plushie {}.", "a photo of the nice {}.", "a photo of the small {}.",
    "a photo of the weird {}.", "the cartoon {}.", "art of the {}.", "a drawing of the {}.",
    "a photo of the large {}.", "a black and white photo of a {}.", "the plushie {}.", "a dark photo of a {}.",
    "itap of a {}.", "graffiti of the {}.", "a toy {}.", "itap of my {}.", "a photo of a cool {}.",
    "a photo of a small {}.", "a tattoo of the {}.",
)  # fmt: skip


def load_templates(spec: str | Path = "") -> tuple[str, ...]:
    """``''`` or ``'clip80'``: :data:`CLIP_IMAGENET_TEMPLATES`; else a file of templates, one per line.

    Raises:
        DataFileMissingError: no such file. DataError: no template, or a template without exactly one ``{}``.
    """
    if str(spec) in ("", "clip80"):
        return CLIP_IMAGENET_TEMPLATES
    path = Path(spec)
    if not path.is_file():
        raise DataFileMissingError(
            f"prompt template file {path} does not exist",
            hint="give a text file with one template per line, '{}' where the class name goes, or '' for "
            "CLIP's 80 ImageNet templates",
        )
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: cannot read the prompt templates ({err})") from None
    out = tuple(s.strip() for s in lines if s.strip() and not s.lstrip().startswith("#"))
    if not out:
        raise DataError(f"{path}: no prompt template (one per line, '{{}}' where the class name goes)")
    bad = [t for t in out if t.count("{}") != 1]
    if bad:
        raise DataError(f"{path}: a template needs exactly one '{{}}' for the class name; got {bad[:3]}")
    return out
