"""The input and output sides of :mod:`.poison_shards` [ours]: the user's data as shards (a folder, a ``.tar``, a
brace pattern as webdataset's) or a table, the poisoned shards' writer, and the poison manifest's reader.
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

from reprlab.errors import ConfigError, DataError, DataFileMissingError
from reprlab.methods.otcclip.data import shards as sh
from reprlab.methods.otcclip.data.shard_reader import expand_shards
from reprlab.methods.otcclip.data.sources import TABLE_SUFFIXES, TableSource


def open_input(source: str | Path, image_root: str | Path = "") -> list[Path] | TableSource:
    """The shard paths of ``source`` (a folder, a ``.tar``, a brace pattern), or a :class:`TableSource`.

    Raises:
        DataFileMissingError: naming the missing file or folder. DataError: not shards nor a table.
    """
    if "{" in str(source):  # a brace pattern: webdataset's expansion, every shard must exist
        return expand_shards(str(source))
    path = Path(source)
    if not path.exists():
        raise DataFileMissingError(
            f"input {path} does not exist",
            hint="give a folder of webdataset .tar shards, a brace pattern (shard-{000000..000009}.tar) or a "
            "CSV/TSV/JSONL of (image path, caption)",
        )
    if path.suffix.lower() in TABLE_SUFFIXES:
        return TableSource(path, image_root or None)
    if path.is_dir() or path.suffix == ".tar":
        return expand_shards(path)
    raise DataError(f"{path} is not a .tar shard, a folder of them or a .csv/.tsv/.jsonl table")


class ShardWriter:
    """Samples into ``poisoned-{i:06d}.tar`` shards cut at planned bounds (``n_out`` samples in shards of
    ``shard_size``, or exactly ``n_shards`` near-equal ones); each shard is written under a temporary name and
    renamed (a crash leaves no truncated ``.tar``), members with :mod:`.shards`' fixed metadata."""

    def __init__(self, out: Path, n_out: int, shard_size: int, n_shards: int = 0):
        if n_shards and n_shards > n_out:
            raise ConfigError(f"n_shards={n_shards} is more than the {n_out} samples written")
        n = n_shards or -(-n_out // shard_size)
        self.bounds = [n_out * s // n for s in range(1, n + 1)] if n_shards else [
            min(n_out, shard_size * s) for s in range(1, n + 1)]  # fmt: skip
        self.out, self.count, self.paths, self.tf, self.shard_size = out, 0, [], None, shard_size

    def add(self, key: str, parts: dict[str, bytes]) -> str:
        """Write one sample (``{key}.{ext}`` per member, in order); returns its shard's file name."""
        if self.tf is None:
            path = self.out / f"poisoned-{len(self.paths):06d}.tar"
            self.paths.append(path)
            self.tf = tarfile.open(path.with_name(path.name + ".tmp"), "w", format=tarfile.USTAR_FORMAT)
        for ext, data in parts.items():
            sh._add(self.tf, f"{key}.{ext}", data)
        self.count += 1
        name = self.paths[-1].name
        if self.count >= self.bounds[min(len(self.paths), len(self.bounds)) - 1]:
            self._finish()
        return name

    def _finish(self) -> None:
        self.tf.close()
        path = self.paths[-1]
        path.with_name(path.name + ".tmp").replace(path)
        self.tf = None

    def close(self) -> list[Path]:
        if self.tf is not None:
            self._finish()
        return self.paths


def read_manifest(path: str | Path) -> dict:
    """A poison manifest (``manifest.json``, or the folder holding it) with its folder as ``_dir``.

    Raises:
        DataFileMissingError: no such file. DataError: not JSON, or no ``poison`` record.
    """
    path = Path(path)
    path = path / sh.MANIFEST if path.is_dir() else path
    if not path.is_file():
        raise DataFileMissingError(f"poison manifest {path} does not exist",
                                   hint="`reprlab otcclip poison` writes it beside the poisoned shards")  # fmt: skip
    try:
        m = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise DataError(f"{path}: not a readable JSON manifest ({err})") from None
    if not isinstance(m, dict) or not isinstance(m.get("poison"), dict):
        raise DataError(f"{path}: no 'poison' record (not written by `reprlab otcclip poison`)")
    return {**m["poison"], "_dir": str(path.parent), "n_samples": m.get("n_samples")}
