"""Image-caption datasets for users with real data (CC3M, COCO, LAION subsets) [ours].

Accepted layouts:

* a CSV/TSV file or a JSONL file of (image path, caption) rows; paths are relative to the file's folder
  (or ``root``). Columns default to ``image`` and ``caption`` (``path``/``file``/``filepath`` and
  ``text``/``title`` are recognised too).
* webdataset tar shards (one ``.tar``, a folder of them, or a glob): members sharing a key, an image
  (``.jpg/.jpeg/.png/.webp``) plus a caption (``.txt``, or ``.json`` with a ``caption`` field).

Bad items never crash a run mid-way: each is counted under its reason and skipped, and the counts go to the
run summary. Reasons: ``missing_image`` (file absent or no image member), ``unreadable_image``,
``missing_image_path`` (empty path field / no path key), ``missing_caption`` (no caption field, member or
key), ``empty_caption``, ``caption_too_long`` (over :data:`MAX_CAPTION_CHARS`), ``non_utf8`` (a line or
caption that is not UTF-8), ``bad_row`` (unparsable CSV line or JSON), ``short_row`` (a CSV row with fewer
fields than the caption/image column), ``unreadable_shard``, ``truncated_shard``, ``duplicate_member`` (shards
are read through webdataset, with its keys: docs/shards.md). File-level problems raise
:class:`reprlab.errors.DataError` naming the file: no recognised image or caption column in a CSV/TSV header
(the message lists the expected names and the ones found), an empty file, an unsupported format, or nothing
valid at all. A header line that is not UTF-8 is decoded with replacement characters (noted in
``LoadReport.notes``) rather than dropped, so the rows keep their columns.
"""

from __future__ import annotations

import csv
import glob
import io
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from reprlab.errors import ConfigError, DataError
from reprlab.methods.otcclip.data.pairs import PairSet, SignatureIndex
from reprlab.methods.otcclip.data.shard_reader import IMAGE_MEMBERS, expand_shards, iter_shard

# [ours] a caption longer than this is not a caption (the csv module's default field limit, 128 KiB)
MAX_CAPTION_CHARS = 128 * 1024


class DataMissingError(DataError, FileNotFoundError):
    """A dataset path that does not exist (a :class:`DataError` that ``except FileNotFoundError`` catches)."""


IMAGE_EXT = (".jpg", ".jpeg", ".png", ".webp", ".bmp")
IMAGE_COLS, CAPTION_COLS = ("image", "path", "file", "filepath", "filename"), ("caption", "text", "title")


@dataclass
class LoadReport:
    """``n_ok`` valid pairs; ``skipped`` counts per reason; ``examples`` the first few (reason, item)."""

    source: str
    n_ok: int = 0
    skipped: Counter = field(default_factory=Counter)
    examples: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

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


def _lines(path: Path, report: LoadReport, header: bool) -> list[tuple[int, str]]:
    """``(line number, text)`` of a CSV/TSV/JSONL file, decoded line by line so one non-UTF-8 line costs one
    row, not the file. A header line (``header=True``) is never dropped: bytes that are not UTF-8 become
    U+FFFD, and if that damages a column name, the missing-column error shows it."""
    out = []
    for n, b in enumerate(path.read_bytes().splitlines(), start=1):
        if n == 1 and b.startswith(b"\xef\xbb\xbf"):  # UTF-8 byte-order mark (Excel exports)
            b = b[3:]
        try:
            out.append((n, b.decode("utf-8")))
        except UnicodeDecodeError:
            if header and not out:
                out.append((n, b.decode("utf-8", errors="replace")))
                report.notes.append(f"{path.name}:{n}: header line is not UTF-8; undecodable bytes replaced")
            else:
                report.skip("non_utf8", f"{path.name}:{n}")
    return out


def _jsonl_rows(path: Path, report: LoadReport):
    """Yield ``(item name, image path or None, caption or None)`` per JSON object line."""
    for n, line in _lines(path, report, header=False):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            report.skip("bad_row", f"{path.name}:{n}")
            continue
        if not isinstance(obj, dict):
            report.skip("bad_row", f"{path.name}:{n}")
            continue
        yield f"{path.name}:{n}", _pick(obj, IMAGE_COLS), _pick(obj, CAPTION_COLS)


def _csv_rows(path: Path, report: LoadReport):
    """Yield ``(item name, image path, caption)`` per CSV/TSV row.

    Raises:
        DataError: an empty file, or a header without a recognised image or caption column (the message
            names the expected names and the ones found).
    """
    delim = "\t" if path.suffix == ".tsv" else ","
    lines = _lines(path, report, header=True)
    if not lines:
        raise DataError(f"{path}: empty file; expected a header line with an image and a caption column")
    header = [h.strip() for h in next(csv.reader([lines[0][1]], delimiter=delim))]
    img_col = next((header.index(c) for c in IMAGE_COLS if c in header), None)
    cap_col = next((header.index(c) for c in CAPTION_COLS if c in header), None)
    if img_col is None or cap_col is None:
        missing = " and ".join(k for k, c in (("image", img_col), ("caption", cap_col)) if c is None)
        raise DataError(
            f"{path}: no {missing} column in the header {header}; expected one of {list(IMAGE_COLS)} for the "
            f"image path and one of {list(CAPTION_COLS)} for the caption",
            hint="rename the header's columns (e.g. 'image,caption')",
        )
    limit = csv.field_size_limit()
    csv.field_size_limit(2**31 - 1)  # long captions are counted as caption_too_long below, not a csv.Error
    try:
        for n, line in lines[1:]:
            if not line.strip():
                continue
            try:
                fields = next(csv.reader([line], delimiter=delim))
            except csv.Error:
                report.skip("bad_row", f"{path.name}:{n}")
                continue
            if len(fields) <= max(img_col, cap_col):
                report.skip("short_row", f"{path.name}:{n}")
                continue
            yield f"{path.name}:{n}", fields[img_col], fields[cap_col]
    finally:
        csv.field_size_limit(limit)


def _pick(row: dict, names: tuple[str, ...]) -> str | None:
    for k in names:
        if row.get(k) is not None:
            return str(row[k])
    return None


def _tar_members(paths: list[Path], report: LoadReport):
    """Yield (``shard:key``, image bytes, caption member or None) from webdataset shards, read through webdataset
    (:mod:`.shard_reader`: webdataset's keys; an absolute or ``..`` member name refuses the shard)."""
    for p in paths:
        skip: Counter = Counter()
        for sample in iter_shard(p, skip):
            img = next((sample[e] for e in IMAGE_MEMBERS if e in sample), None)
            yield f"{p.name}:{sample['__key__']}", img, sample.get("txt", sample.get("json"))
        for reason, n in skip.items():
            for _ in range(n):
                report.skip(reason, p.name)


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
        DataMissingError: ``source`` does not exist (also a ``FileNotFoundError``). DataError: a file-level
        problem (see the module docstring), or nothing valid was found (the message gives the skip counts).
        ConfigError: ``max_items < 1``.
    """
    src = Path(source)
    report = LoadReport(str(source))
    images, captions, names = [], [], []

    def add(name: str, img_src, caption) -> None:
        if caption is None:
            report.skip("missing_caption", name)
            return
        if not str(caption).strip():
            report.skip("empty_caption", name)
            return
        if len(str(caption)) > MAX_CAPTION_CHARS:
            report.skip("caption_too_long", name)
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

    if max_items is not None and max_items < 1:
        raise ConfigError(f"max_items must be >= 1 (or None for all); got {max_items}")
    shards = sorted(glob.glob(str(source))) if any(c in str(source) for c in "*?[") else None
    if "{" in str(source):  # a webdataset brace pattern: every shard it names must exist
        shards = [str(p) for p in expand_shards(str(source))]
    if shards is not None and not shards:
        raise DataMissingError(f"dataset glob {source} matches no file")
    if shards is None and not src.exists():
        raise DataMissingError(f"dataset {src} does not exist")
    if shards is None and src.is_dir():
        shards = sorted(str(p) for p in src.glob("*.tar"))
        if not shards:
            raise DataError(f"{src} is a folder without .tar shards; pass a CSV/TSV/JSONL file or shards")
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
                        obj = json.loads(text)
                    except ValueError:
                        report.skip("bad_row", name)
                        continue
                    text = _pick(obj, CAPTION_COLS) if isinstance(obj, dict) else None
                cap = text
            add(name, img, cap)
            if max_items and len(captions) >= max_items:
                break
    elif src.suffix in (".csv", ".tsv", ".jsonl"):
        base = Path(root) if root else src.parent
        rows = _jsonl_rows(src, report) if src.suffix == ".jsonl" else _csv_rows(src, report)
        for item, path, cap in rows:
            if path is None or not path.strip():
                report.skip("missing_image_path", item)
                continue
            add(path, base / path, cap)
            if max_items and len(captions) >= max_items:
                break
    else:
        raise DataError(
            f"{src}: unsupported dataset format {src.suffix!r}; use .csv/.tsv/.jsonl or .tar shards"
        )
    report.n_ok = len(captions)
    if not captions:
        raise DataError(
            f"{source}: no valid image-caption pairs (skipped: {dict(report.skipped)})",
            hint="; ".join(f"{r}: {item}" for r, item in report.examples[:3]) or None,
        )
    sigs = SignatureIndex()
    sig = torch.tensor([sigs(frozenset({c.lower()})) for c in captions])
    n = len(captions)
    pairs = PairSet(
        torch.from_numpy(np.stack(images)), captions, torch.zeros(n, dtype=torch.long), sig, torch.arange(n)
    )
    return pairs, names, report
