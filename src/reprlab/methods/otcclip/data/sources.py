"""Streamed image-caption sources: webdataset-layout shards or a CSV/TSV/JSONL table of (image path, caption),
read item by item (by DataLoader workers, :mod:`..training.slots`), never all in RAM [ours].

A source yields ``(name, image bytes or path, caption, metadata)`` for its slot's share: a shard source gives
slot ``s`` the shards ``order[s::slots]`` (``order`` permuted per epoch with ``shuffle``), a table gives it rows
``i`` with ``i % slots == s``. Shards are read through webdataset (:mod:`.shard_reader`: webdataset's keys,
brace patterns, member-name checks); unreadable or truncated shards and unparsable rows are skipped and counted
per reason, or with ``on_bad="error"`` stop the run naming the shard. A new format is a new source class with
the same methods.
"""

from __future__ import annotations

import csv
import json
import tarfile
import warnings
from collections import Counter
from pathlib import Path

import numpy as np

from reprlab.errors import ConfigError, DataError, DataFileMissingError
from reprlab.methods.otcclip.data import shard_reader as rd
from reprlab.methods.otcclip.data.datasets import CAPTION_COLS, IMAGE_COLS
from reprlab.methods.otcclip.data.shards import MANIFEST

TABLE_SUFFIXES = (".csv", ".tsv", ".jsonl")


class ShardSource:
    """Webdataset-layout shards (a folder, one ``.tar``, a brace pattern or a list), read through webdataset.

    Args:
        source: the shards (:func:`~.shard_reader.expand_shards`).
        on_bad: ``"skip"`` or ``"error"`` for corrupt shards and bad members (``stream.on_bad_sample``).
    """

    def __init__(self, source: str | Path | list, on_bad: str = "skip"):
        self.shards = rd.expand_shards(source)
        self.name = str(source)
        self.on_bad = on_bad

    def __len__(self) -> int:
        return len(self.shards)

    def items(
        self, slot: int, slots: int, seed: int, epoch: int, shuffle: bool, skip: Counter, cycle: int = 0
    ):
        """``(name, image bytes, caption, metadata)`` of the slot's shards (name = ``shard:key``); bad shards and
        members are counted in ``skip`` (or raise, with ``on_bad="error"``). ``cycle``: the pass over a cycled
        clean source (0 = the epoch's first, whose order is the usual one)."""
        order = list(range(len(self.shards)))
        if shuffle:
            key = [seed, epoch] if cycle == 0 else [seed, epoch, cycle]
            order = np.random.default_rng(key).permutation(order).tolist()
        for i in order[slot::slots]:
            path = self.shards[i]
            for sample in rd.iter_shard(path, skip, self.on_bad):
                name = f"{path.name}:{sample['__key__']}"
                try:
                    image, caption, meta = rd.split_sample(sample)
                except UnicodeDecodeError:
                    self._bad(skip, "non_utf8", name)
                    continue
                except ValueError:
                    self._bad(skip, "bad_row", name)
                    continue
                yield name, image, caption, meta

    def _bad(self, skip: Counter, reason: str, name: str) -> None:
        if self.on_bad == "error":
            raise rd.BadSampleError(f"{name}: {reason.replace('_', ' ')}")
        skip[reason] += 1

    def manifest(self) -> dict | None:
        """manifest.json of the shards' folder when it lists exactly these shards, else ``None``."""
        path = self.shards[0].parent / MANIFEST
        if path.exists():
            m = json.loads(path.read_text())
            if sorted(m.get("shards", [])) == sorted(p.name for p in self.shards):
                return m
        return None

    def count(self) -> int:
        """Samples in the shards: manifest.json's count when present, else one pass over the members."""
        if (m := self.manifest()) is not None:
            return int(m["n_samples"])
        return sum(1 for p in self.shards for _ in rd.iter_shard(p))

    def n_poisoned(self) -> int:
        """Samples whose provenance (``kind`` != 0 in the ``.json`` member) says poisoned: manifest.json's
        ``n_poisoned`` when present, else one pass over the members (no image decoded)."""
        if (m := self.manifest()) is not None and "n_poisoned" in m:
            return int(m["n_poisoned"])
        n = 0
        for _, _, _, meta in self.items(0, 1, 0, 0, False, Counter()):
            n += int(meta.get("kind", 0)) != 0
        return n

    def captions(self, limit: int) -> list[str]:
        out: list[str] = []
        for _, _, caption, _ in self.items(0, 1, 0, 0, False, Counter()):
            if caption:
                out.append(caption)
            if len(out) >= limit:
                break
        return out


class TableSource:
    """A CSV/TSV/JSONL of (image path, caption), read line by line (image paths relative to ``root``)."""

    def __init__(self, path: str | Path, root: str | Path | None = None):
        self.path = Path(path)
        self.root = Path(root) if root else self.path.parent
        self.name = str(path)
        self.delim = "\t" if self.path.suffix == ".tsv" else ","
        self.cols = self._header() if self.path.suffix != ".jsonl" else None

    def __len__(self) -> int:
        return 1

    def _header(self) -> tuple[int, int]:
        with open(self.path, "rb") as f:
            line = f.readline().removeprefix(b"\xef\xbb\xbf").decode("utf-8", errors="replace")
        if not line.strip():
            raise DataError(
                f"{self.path}: empty file; expected a header line with an image and a caption column"
            )
        header = [h.strip() for h in next(csv.reader([line], delimiter=self.delim))]
        img = next((header.index(c) for c in IMAGE_COLS if c in header), None)
        cap = next((header.index(c) for c in CAPTION_COLS if c in header), None)
        if img is None or cap is None:
            raise DataError(
                f"{self.path}: no {'image' if img is None else 'caption'} column in the header {header}; expected "
                f"one of {list(IMAGE_COLS)} for the image path and one of {list(CAPTION_COLS)} for the caption"
            )
        return img, cap

    def _rows(self, skip: Counter):
        """``(row number, image path or None, caption or None)`` of every data row."""
        big = csv.field_size_limit()
        csv.field_size_limit(2**31 - 1)  # over-long captions are counted below, not a csv.Error
        try:
            with open(self.path, "rb") as f:
                if self.cols is not None:
                    f.readline()
                for n, raw in enumerate(f):
                    try:
                        line = raw.decode("utf-8").rstrip("\r\n")
                    except UnicodeDecodeError:
                        skip["non_utf8"] += 1
                        continue
                    if not line.strip():
                        continue
                    if self.cols is None:
                        try:
                            obj = json.loads(line)
                        except ValueError:
                            skip["bad_row"] += 1
                            continue
                        if not isinstance(obj, dict):
                            skip["bad_row"] += 1
                            continue
                        path = next((str(obj[k]) for k in IMAGE_COLS if obj.get(k) is not None), None)
                        cap = next((str(obj[k]) for k in CAPTION_COLS if obj.get(k) is not None), None)
                        yield n, path, cap
                        continue
                    try:
                        fields = next(csv.reader([line], delimiter=self.delim))
                    except csv.Error:
                        skip["bad_row"] += 1
                        continue
                    if len(fields) <= max(self.cols):
                        skip["short_row"] += 1
                        continue
                    yield n, fields[self.cols[0]], fields[self.cols[1]]
        finally:
            csv.field_size_limit(big)

    def items(
        self, slot: int, slots: int, seed: int, epoch: int, shuffle: bool, skip: Counter, cycle: int = 0
    ):
        """Rows ``i % slots == slot`` in file order (a table has no shard order: ``shuffle``/``cycle`` unused)."""
        for n, path, cap in self._rows(skip if slot == 0 else Counter()):  # row-level skips counted once
            if n % slots != slot:
                continue
            if path is None or not path.strip():
                skip["missing_image_path"] += 1
                continue
            yield f"{self.path.name}:{n + 1}", self.root / path, cap, {"index": n}

    def count(self) -> int:
        return sum(1 for _ in self._rows(Counter()))

    def n_poisoned(self) -> int:
        """A table carries no provenance: nothing is known to be poisoned."""
        return 0

    def captions(self, limit: int) -> list[str]:
        out: list[str] = []
        for _, _, cap in self._rows(Counter()):
            if cap and cap.strip():
                out.append(cap)
            if len(out) >= limit:
                break
        return out


def open_source(source: str | Path, image_root: str = "", key: str = "stream.source", on_bad: str = "skip"):
    """A :class:`ShardSource` or :class:`TableSource` for ``source``; a brace pattern
    (``shards/train-{000000..000099}.tar``) is shards.

    Raises:
        DataFileMissingError: ``source`` (or a shard of its pattern) does not exist (the message names ``key``).
        DataError: not a table, a ``.tar``, a folder of them or a pattern of them.
    """
    path = Path(source)
    if not str(source):
        raise ConfigError(
            f"{key} is empty: give a folder of .tar shards or a CSV/TSV/JSONL of (image, caption)"
        )
    if "{" in str(source) or "::" in str(source):
        try:
            return ShardSource(str(source), on_bad)
        except DataError as err:
            raise type(err)(f"{key}: {err}", hint=err.hint) from err
    if not path.exists():
        raise DataFileMissingError(
            f"{key}: {path} does not exist",
            hint="point it at a folder of webdataset .tar shards (e.g. written by img2dataset or "
            "`reprlab otcclip make-shards`) or at a CSV/TSV/JSONL of (image path, caption)",
        )
    if path.suffix in TABLE_SUFFIXES:
        table = TableSource(path, image_root or None)
        skip: Counter = Counter()
        if next(table._rows(skip), None) is None:  # stops at the first row: cheap on a 3M-row table
            found = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in sorted(skip.items())) or "no line"
            raise DataError(
                f"{key}: {path} holds no data row ({found})",
                hint="one (image path, caption) per line: a CSV/TSV with a header, or JSONL objects such as "
                '{"image": "a.jpg", "caption": "a photo of a dog"}',
            )
        return table
    if path.is_dir() or path.suffix == ".tar":
        try:
            return ShardSource(path, on_bad)
        except FileNotFoundError as err:
            raise DataFileMissingError(f"{key}: {err}") from err
    raise DataError(f"{key}: {path} is not a .tar shard, a folder of them or a .csv/.tsv/.jsonl table")


def check_slots(source, key: str, slots: int) -> None:
    """Refuse more ``stream.slots`` than ``source`` has shards (a slot would be empty); a table splits by rows.

    Raises:
        ConfigError: naming ``key``, the source and both counts.
    """
    if isinstance(source, ShardSource) and len(source) < slots:
        raise ConfigError(
            f"stream.slots {slots} exceeds the {len(source)} shards of {key} {source.name}: a slot would be empty",
            hint=f"set stream.slots to at most {len(source)}, or write the data as more shards",
        )


def check_shard_heads(source, key: str, on_bad: str = "skip") -> None:
    """Open each shard of ``source`` and read its first member's header (512 bytes, or the first compressed
    block), so that a file that is not a tar archive is named before the run folder exists; a tar corrupt further
    in is found when it is read. No-op for a table.

    Raises:
        DataError: no shard opens, or (``on_bad="error"``) any does not, naming them and why. With ``"skip"``
        some unreadable shards are a warning: the stream skips them and counts them.
    """
    if not isinstance(source, ShardSource):
        return
    bad: list[str] = []
    for path in source.shards:
        try:
            with tarfile.open(path, "r|*") as tar:
                tar.next()  # the first header only
        except (tarfile.TarError, OSError, EOFError) as err:
            bad.append(f"{path.name} ({err or type(err).__name__})")
    if not bad:
        return
    shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
    what = (
        f"{key}: {len(bad)} of the {len(source)} shards of {source.name} do not open as tar archives: {shown}"
    )
    if len(bad) == len(source):
        raise DataError(what, hint="write webdataset shards (img2dataset, `reprlab otcclip make-shards`)")
    if on_bad == "error":
        raise DataError(what, hint="remove or re-write them, or set stream.on_bad_sample=skip to skip them")
    warnings.warn(f"{what}; they will be skipped (stream.on_bad_sample=skip)", stacklevel=2)


def check_clean_source(source, key: str = "stream.clean_source") -> None:
    """Refuse a clean fine-tuning source whose provenance says it holds poisoned items (as the in-memory trainer
    refuses a clean set with poisoned pairs); a source without provenance (a table, shards without ``kind``)
    passes.

    Raises:
        DataError: naming ``key``, the source and the poisoned count.
    """
    n = source.n_poisoned()
    if n:
        raise DataError(
            f"{key}: {source.name} holds {n} poisoned items (provenance kind != 0); a clean fine-tuning set "
            "must be clean",
            hint="write one with `reprlab otcclip make-shards OUT --clean-finetune-pairs N` or point "
            f"{key} at data you know to be clean",
        )
