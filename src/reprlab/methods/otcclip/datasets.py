"""Image-caption datasets for users with real data (CC3M, COCO, LAION subsets) [ours].

Accepted layouts:

* a CSV/TSV file or a JSONL file of (image path, caption) rows; paths are relative to the file's folder
  (or ``root``). Columns default to ``image`` and ``caption`` (``path``/``file``/``filepath`` and
  ``text``/``title`` are recognised too).
* webdataset tar shards (one ``.tar``, a folder of them, or a glob): members sharing a key, an image
  (``.jpg/.jpeg/.png/.webp``) plus a caption (``.txt``, or ``.json`` with a ``caption`` field).

Bad items never crash a run mid-way: unreadable or missing images, empty captions, non-UTF-8 text and
malformed rows are counted per reason and skipped, and the counts go to the run summary. A dataset with
nothing valid fails at once with an error naming the file.
"""

from __future__ import annotations

import csv
import glob
import io
import json
import tarfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from reprlab.methods.otcclip.mosaic import PairSet, SignatureIndex

IMAGE_EXT = (".jpg", ".jpeg", ".png", ".webp", ".bmp")
IMAGE_COLS, CAPTION_COLS = ("image", "path", "file", "filepath", "filename"), ("caption", "text", "title")


@dataclass
class LoadReport:
    """``n_ok`` valid pairs; ``skipped`` counts per reason; ``examples`` the first few (reason, item)."""

    source: str
    n_ok: int = 0
    skipped: Counter = field(default_factory=Counter)
    examples: list[tuple[str, str]] = field(default_factory=list)

    def skip(self, reason: str, item: str) -> None:
        self.skipped[reason] += 1
        if len(self.examples) < 10:
            self.examples.append((reason, item))

    def as_summary(self, prefix: str = "data") -> dict[str, int]:
        return {
            f"{prefix}.n_ok": self.n_ok,
            **{f"{prefix}.skipped_{k}": v for k, v in sorted(self.skipped.items())},
        }


def _image(data: bytes | Path, size: int, channels: int) -> np.ndarray:
    """Decode, resize (shorter side, centre crop) to ``uint8 (C, size, size)``; raises on bad bytes."""
    from PIL import Image

    src = io.BytesIO(data) if isinstance(data, bytes) else data
    with Image.open(src) as im:
        im = im.convert("L" if channels == 1 else "RGB")
        w, h = im.size
        s = min(w, h)
        im = im.crop(((w - s) // 2, (h - s) // 2, (w - s) // 2 + s, (h - s) // 2 + s)).resize((size, size))
        arr = np.asarray(im, dtype=np.uint8)
    return arr[None] if channels == 1 else arr.transpose(2, 0, 1)


def _rows(path: Path, report: LoadReport) -> list[dict]:
    """Decode a CSV/TSV/JSONL file line by line so one non-UTF-8 line costs one row, not the file."""
    raw = path.read_bytes().splitlines()
    lines = []
    for n, b in enumerate(raw):
        try:
            lines.append(b.decode("utf-8"))
        except UnicodeDecodeError:
            report.skip("non_utf8", f"{path.name}:{n + 1}")
    if path.suffix == ".jsonl":
        rows = []
        for n, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                if not isinstance(obj, dict):
                    raise ValueError("not an object")
                rows.append(obj)
            except ValueError:
                report.skip("bad_row", f"{path.name}:{n + 1}")
        return rows
    delim = "\t" if path.suffix == ".tsv" else ","
    return list(csv.DictReader(lines, delimiter=delim))


def _pick(row: dict, names: tuple[str, ...]) -> str | None:
    for k in names:
        if row.get(k) is not None:
            return str(row[k])
    return None


def _tar_members(paths: list[Path], report: LoadReport):
    """Yield (key, image bytes, caption or None) from webdataset shards."""
    for p in paths:
        try:
            tf = tarfile.open(p)
        except (tarfile.TarError, OSError) as err:
            report.skip("unreadable_shard", f"{p.name}: {err}")
            continue
        groups: dict[str, dict[str, bytes]] = {}
        with tf:
            for m in tf.getmembers():
                if not m.isfile():
                    continue
                key, _, ext = m.name.partition(".")
                groups.setdefault(key, {})[ext.lower()] = tf.extractfile(m).read()
        for key, parts in groups.items():
            img = next((parts[e] for e in ("jpg", "jpeg", "png", "webp", "bmp") if e in parts), None)
            yield f"{p.name}:{key}", img, parts.get("txt", parts.get("json"))


def load_pairs(
    source: str | Path,
    image_size: int = 56,
    channels: int = 1,
    root: str | Path | None = None,
    max_items: int | None = None,
) -> tuple[PairSet, list[str], LoadReport]:
    """Load an image-caption dataset.

    Args:
        source: CSV/TSV/JSONL file, a ``.tar`` shard, a folder of shards, or a glob of shards.
        image_size: output side; images are centre-cropped and resized.
        channels: 1 (greyscale) or 3.
        root: folder image paths are relative to (default: the table's folder).
        max_items: stop after this many valid pairs.

    Returns:
        ``(pairs, image_names, report)``; ``pairs.sig`` groups identical captions.

    Raises:
        FileNotFoundError: ``source`` does not exist. ValueError: nothing valid was found (the message
        gives the skip counts).
    """
    src = Path(source)
    report = LoadReport(str(source))
    images, captions, names = [], [], []

    def add(name: str, img_src, caption) -> None:
        if caption is None or not str(caption).strip():
            report.skip("empty_caption", name)
            return
        if img_src is None:
            report.skip("missing_image", name)
            return
        if isinstance(img_src, Path) and not img_src.exists():
            report.skip("missing_image", name)
            return
        try:
            images.append(_image(img_src, image_size, channels))
        except Exception as err:  # PIL raises many types for corrupt files
            report.skip("unreadable_image", f"{name}: {type(err).__name__}")
            return
        captions.append(str(caption).strip())
        names.append(name)

    shards = sorted(glob.glob(str(source))) if any(c in str(source) for c in "*?[") else None
    if shards is None and not src.exists():
        raise FileNotFoundError(f"dataset {src} does not exist")
    if shards is None and src.is_dir():
        shards = sorted(str(p) for p in src.glob("*.tar"))
        if not shards:
            raise ValueError(f"{src} is a folder without .tar shards; pass a CSV/TSV/JSONL file or shards")
    if shards is None and src.suffix == ".tar":
        shards = [str(src)]
    if shards is not None:
        for name, img, cap in _tar_members([Path(s) for s in shards], report):
            if cap is not None:
                try:
                    text = cap.decode("utf-8")
                except UnicodeDecodeError:
                    report.skip("non_utf8", name)
                    continue
                if text.lstrip().startswith("{"):
                    try:
                        text = json.loads(text).get("caption", "")
                    except ValueError:
                        report.skip("bad_row", name)
                        continue
                cap = text
            add(name, img, cap)
            if max_items and len(captions) >= max_items:
                break
    elif src.suffix in (".csv", ".tsv", ".jsonl"):
        base = Path(root) if root else src.parent
        for n, row in enumerate(_rows(src, report)):
            path, cap = _pick(row, IMAGE_COLS), _pick(row, CAPTION_COLS)
            if path is None:
                report.skip("bad_row", f"{src.name}:{n + 2}")
                continue
            add(path, base / path, cap)
            if max_items and len(captions) >= max_items:
                break
    else:
        raise ValueError(
            f"{src}: unsupported dataset format {src.suffix!r}; use .csv/.tsv/.jsonl or .tar shards"
        )
    report.n_ok = len(captions)
    if not captions:
        raise ValueError(f"{source}: no valid image-caption pairs (skipped: {dict(report.skipped)})")
    sigs = SignatureIndex()
    sig = torch.tensor([sigs(frozenset({c.lower()})) for c in captions])
    n = len(captions)
    pairs = PairSet(
        torch.from_numpy(np.stack(images)), captions, torch.zeros(n, dtype=torch.long), sig, torch.arange(n)
    )
    return pairs, names, report
