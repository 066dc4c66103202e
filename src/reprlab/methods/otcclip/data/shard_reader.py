"""Reading webdataset shards through the webdataset library, with webdataset's semantics [ours: the checks].

* **Shard specs.** A folder (its ``*.tar``, sorted), one ``.tar``, a list of them, or a webdataset brace pattern
  (``shards/train-{000000..000099}.tar``, several joined by ``::``), expanded by webdataset's own
  ``shardlists.expand_urls`` (braceexpand). Every expanded shard must exist: a missing one is named.
* **Samples** are grouped by ``webdataset.tariterators.group_by_keys`` over ``tar_file_iterator``: consecutive
  members sharing a key, the member's path up to the first dot of its file name (``a/0001.jpg`` and
  ``b/0001.jpg`` are two samples, keys ``a/0001`` and ``b/0001``); the extension after that dot, lower-cased,
  names the part; ``__*__`` metadata members are skipped. The webdataset pipeline (``WebDataset``) is not used
  to order shards: the stream's slots and windows (:mod:`..training.slots`) fix that order themselves, so that a
  run resumes bitwise and gives the same batches whatever the ranks and workers; only the per-shard tar
  iteration and key grouping come from the library.
* **Checks** [ours]. A member name that is absolute or has a ``..`` component is refused: an
  :class:`UnsafeShardError` naming the shard and the member (such an archive was crafted, not damaged).
* **Bad samples** (``on_bad``): a shard that cannot be opened (``unreadable_shard``), one that breaks off
  mid-way (``truncated_shard``: the samples before the break are kept, the incomplete one is dropped), a
  repeated member inside a sample (``duplicate_member``: the first is kept) are counted by reason and skipped
  with ``"skip"``; with ``"error"`` the first one raises a :class:`BadSampleError` naming the shard.
"""

from __future__ import annotations

import json
import re
import tarfile
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path, PurePosixPath

from webdataset.shardlists import expand_urls
from webdataset.tariterators import group_by_keys, tar_file_iterator

from reprlab.errors import DataError, DataFileMissingError

IMAGE_MEMBERS = ("png", "jpg", "jpeg", "webp", "bmp")
BAD_SAMPLE_POLICIES = ("skip", "error")


class BadSampleError(DataError):
    """A corrupt or truncated shard (or a bad sample in one) under ``on_bad="error"``; names the shard."""


class UnsafeShardError(DataError):
    """A shard member whose name is absolute or climbs out with ``..``; names the shard and the member."""


def expand_shards(spec: str | Path | Iterable) -> list[Path]:
    """The shard files of ``spec`` (module docstring), in order.

    Raises:
        DataFileMissingError: a folder without ``.tar`` files, or shards that do not exist (the first few named).
    """
    if not isinstance(spec, str | Path):
        return [Path(p) for p in spec]
    text = str(spec)
    if "{" in text or "::" in text:
        try:
            paths = [Path(p) for p in expand_urls(text)]
        except AssertionError as err:  # webdataset asserts on a ${var} it cannot substitute
            raise DataError(f"shard pattern {text}: {err}") from err
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise DataFileMissingError(
                f"shard pattern {text}: {len(missing)} of its {len(paths)} shards do not exist "
                f"(e.g. {', '.join(missing[:3])})"
            )
        return paths
    path = Path(text)
    if not path.exists():
        raise DataFileMissingError(f"no shard or folder at {path}")
    paths = sorted(path.glob("*.tar")) if path.is_dir() else [path]
    if not paths:
        raise DataFileMissingError(f"no .tar shards in {path}")
    return paths


def check_member_name(name: str, shard: Path | str) -> None:
    """Refuse an absolute member name or one with a ``..`` component.

    Raises:
        UnsafeShardError: naming the shard and the member.
    """
    p = PurePosixPath(name)
    if p.is_absolute() or ".." in p.parts:
        raise UnsafeShardError(
            f"{Path(shard).name}: member {name!r} is {'absolute' if p.is_absolute() else 'outside the archive'}; "
            "refusing the shard",
            hint="rewrite the shard with relative member names (webdataset's ShardWriter does)",
        )


def iter_shard(
    path: Path, skip: Counter | None = None, on_bad: str = "skip", fast: bool = True
) -> Iterator[dict]:
    """Samples of one shard in file order, as webdataset gives them: ``{"__key__", "__url__", ext: bytes}``.

    Args:
        path: the shard.
        skip: counts per reason of what was skipped (module docstring); a fresh Counter when ``None``.
        on_bad: ``"skip"`` (count and go on) or ``"error"`` (raise at the first bad shard or member).
        fast: members of plain ustar tars from :func:`_ustar_members` (same members as webdataset's
            ``tar_file_iterator``, which reads everything else; docs/shards.md has the benchmark); ``False``:
            ``tar_file_iterator`` throughout.

    Raises:
        UnsafeShardError: an absolute or ``..`` member name (whatever ``on_bad``). BadSampleError: with
        ``on_bad="error"``, an unreadable or truncated shard or a duplicate member.
    """
    if on_bad not in BAD_SAMPLE_POLICIES:
        raise ValueError(f"on_bad must be one of {BAD_SAMPLE_POLICIES}; got {on_bad!r}")
    skip = Counter() if skip is None else skip
    path = Path(path)
    read = 0

    def duplicate(exn: Exception) -> bool:  # group_by_keys' handler: only its own errors come here
        if on_bad == "error":
            raise BadSampleError(f"{path.name}: {exn.args[0]}") from exn
        skip["duplicate_member"] += 1
        return True

    def members() -> Iterator[dict]:
        nonlocal read
        for name, data in _members(path, fast):
            check_member_name(name, path)
            read += 1
            yield {"fname": name, "data": data, "__url__": str(path)}

    try:
        yield from group_by_keys(members(), handler=duplicate)
    except (tarfile.TarError, OSError, EOFError) as err:
        reason = "truncated_shard" if read else "unreadable_shard"
        if on_bad == "error":
            what = "breaks off after" if read else "cannot be read before"
            raise BadSampleError(
                f"{path.name}: shard {what} member {read} ({type(err).__name__}: {err})",
                hint="re-download or rewrite it, or set stream.on_bad_sample=skip to skip and count it",
            ) from err
        skip[reason] += 1


def _members(path: Path, fast: bool) -> Iterator[tuple[str, bytes]]:
    """``(member name, bytes)`` of the members webdataset's ``tar_file_iterator`` yields, in order: from
    :func:`_ustar_members` while the headers are plain, then (a pax, GNU or compressed tar) from
    ``tar_file_iterator`` itself, resuming after the members already yielded."""
    done = 0
    if fast:
        try:
            for member in _ustar_members(path):
                yield member
                done += 1
            return
        except _NotPlain:
            pass
    with open(path, "rb") as f:
        for i, m in enumerate(tar_file_iterator(f)):
            if i >= done:
                yield m["fname"], m["data"]


class _NotPlain(Exception):
    """A tar header the fast reader leaves to ``tarfile``."""


_META = re.compile(r"__[^/]*__($|/)")  # webdataset's skip_meta: members it never yields


def _ustar_members(path: Path) -> Iterator[tuple[str, bytes]]:
    """Regular members of a plain ustar/v7 tar, with ``tarfile``'s names (ustar prefix joined) and webdataset's
    filter (``__*__`` metadata dropped). Anything else (pax or GNU headers, links, a bad checksum, base-256
    sizes, a compressed or empty file) raises :class:`_NotPlain` before its member is yielded."""
    with open(path, "rb") as f:
        offset = 0
        while True:
            hdr = f.read(512)
            if len(hdr) < 512 or hdr.count(0) == 512:
                if offset == 0:
                    raise _NotPlain  # an empty or odd file: tarfile says what is wrong
                return  # tarfile ends here too (an end block, or a header cut short)
            try:
                checksum = int(hdr[148:156].split(b"\0", 1)[0].strip() or b"-1", 8)
                size = int(hdr[124:136].split(b"\0", 1)[0].strip() or b"0", 8)
            except ValueError:  # not octal: not a plain header (or not a tar)
                raise _NotPlain from None
            kind = hdr[156:157]
            if (
                hdr[124] & 0x80
                or sum(hdr[:148]) + 256 + sum(hdr[156:]) != checksum
                or kind not in (b"0", b"\0", b"5")
            ):
                raise _NotPlain
            data = f.read(size)
            if len(data) < size:
                raise tarfile.ReadError("unexpected end of data")
            f.seek((-size) % 512, 1)
            offset += 512 + size
            name = hdr[:100].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            if kind == b"5" or name.endswith("/"):
                continue
            if hdr[257:262] == b"ustar" and (prefix := hdr[345:500].split(b"\0", 1)[0]):
                name = prefix.decode("utf-8", "surrogateescape") + "/" + name
            if ("/" not in name and name.startswith("__") and name.endswith("__")) or _META.match(name):
                continue
            yield name, data


def split_sample(sample: dict) -> tuple[bytes | None, str | None, dict]:
    """A sample's ``(image bytes, caption, metadata)``; the caption is the ``.txt`` member, else the
    ``caption``/``text`` field of the ``.json`` member (the img2dataset layout). ``None`` where absent.

    Raises:
        UnicodeDecodeError, ValueError: a caption that is not UTF-8, a ``.json`` member that is not JSON.
    """
    image = next((sample[e] for e in IMAGE_MEMBERS if e in sample), None)
    meta = json.loads(sample["json"]) if "json" in sample else {}
    meta = meta if isinstance(meta, dict) else {}
    if "txt" in sample:
        caption = sample["txt"].decode("utf-8")
    else:
        caption = next((str(meta[k]) for k in ("caption", "text") if meta.get(k) is not None), None)
    return image, caption, meta


def parts(sample: dict) -> dict[str, bytes]:
    """A sample's members by extension (the ``__key__``/``__url__`` fields dropped)."""
    return {k: v for k, v in sample.items() if not k.startswith("__")}
