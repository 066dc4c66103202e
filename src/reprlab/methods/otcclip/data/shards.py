"""Image-caption pairs as webdataset tar shards, and a streaming dataset over shards [ours].

Layout (the webdataset convention, so ``webdataset.WebDataset`` and ``reprlab otcclip audit`` read it): POSIX
tar files ``{prefix}-{i:06d}.tar``; a sample is consecutive members sharing a key (the member path up to the
first dot of its file name; reading is :mod:`.shard_reader`, through webdataset): ``{key}.png`` (lossless PNG,
greyscale or RGB), ``{key}.txt`` (the caption, UTF-8) and ``{key}.json`` (``index``, ``kind`` 0 clean / 1 targeted / 2 backdoor, ``image_id``, ``sig``: provenance for
diagnostics, never seen by a defense). Shards are written with the standard library's ``tarfile`` (no
webdataset dependency), with fixed member metadata so the same pairs give byte-identical shards, and each
shard is written under a temporary name and renamed, so a crash never leaves a truncated ``.tar``.
``manifest.json`` lists the shards, the sample count, the count of poisoned samples and the class names.

:class:`ShardStream` is a ``torch.utils.data.IterableDataset``: its shards are split across ranks, then
across DataLoader workers (webdataset's ``split_by_node`` / ``split_by_worker``), and each worker reads its
shards sequentially in tar streaming mode, one sample at a time, so memory holds one sample per worker (plus
the optional shuffle buffer), never the dataset.
"""

from __future__ import annotations

import io
import json
import tarfile
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info
from webdataset.shardlists import split_by_node, split_by_worker

from reprlab.methods.otcclip.data.pairs import PairSet
from reprlab.methods.otcclip.data.shard_reader import expand_shards, iter_shard, parts, split_sample

MANIFEST = "manifest.json"


def _png(image: torch.Tensor) -> bytes:
    """``uint8 (C, H, W)`` with C in {1, 3} -> PNG bytes."""
    from PIL import Image

    arr = image.numpy()
    arr = arr[0] if arr.shape[0] == 1 else arr.transpose(1, 2, 0)
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(arr)).save(buf, format="PNG")
    return buf.getvalue()


def _decode_png(data: bytes) -> torch.Tensor:
    """PNG bytes -> ``uint8 (C, H, W)`` (greyscale keeps one channel)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        arr = np.array(im, dtype=np.uint8)  # a writable copy (asarray of a PIL image is read-only)
    arr = arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)
    return torch.from_numpy(np.ascontiguousarray(arr))


def _add(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644  # fixed metadata: reproducible shards
    tf.addfile(info, io.BytesIO(data))


def write_shards(
    pairs: PairSet,
    out: Path,
    shard_size: int = 1000,
    prefix: str = "mosaics",
    shuffle_seed: int | None = None,
    n_shards: int | None = None,
) -> list[Path]:
    """Write ``pairs`` as tar shards of ``shard_size`` samples into ``out``; returns the shard paths.
    ``n_shards``: instead, exactly that many shards of near-equal size (``shard_size`` is then only recorded).

    Keys are the zero-padded pair index. Without ``shuffle_seed`` shard order = pair order; with it the pairs
    are written in a seeded random order [ours], as web shards hold them: our testbeds append their poisons
    last, and a stream that shuffles only within shards and windows would otherwise meet them in a block.

    Raises:
        ValueError: ``shard_size < 1`` or no pairs.
    """
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1; got {shard_size}")
    if len(pairs) == 0:
        raise ValueError("no pairs to write")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    order = list(range(len(pairs)))
    if shuffle_seed is not None:
        order = np.random.default_rng([shuffle_seed, 4242]).permutation(len(pairs)).tolist()
    n = len(pairs)
    if n_shards is None:
        bounds = [*range(0, n, shard_size), n]
    elif 1 <= n_shards <= n:
        bounds = [n * s // n_shards for s in range(n_shards + 1)]
    else:
        raise ValueError(f"cannot cut {n} samples into {n_shards} non-empty shards")
    for shard, (start, stop) in enumerate(zip(bounds, bounds[1:])):
        path = out / f"{prefix}-{shard:06d}.tar"
        tmp = path.with_name(path.name + ".tmp")
        with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tf:
            for i in order[start:stop]:
                key = f"{i:09d}"
                meta = {
                    "index": i,
                    "kind": int(pairs.kind[i]),
                    "image_id": int(pairs.image_id[i]),
                    "sig": int(pairs.sig[i]),
                }
                _add(tf, f"{key}.png", _png(pairs.images[i]))
                _add(tf, f"{key}.txt", pairs.captions[i].encode("utf-8"))
                _add(tf, f"{key}.json", json.dumps(meta, sort_keys=True).encode("utf-8"))
        tmp.replace(path)
        paths.append(path)
    manifest = {
        "n_samples": len(pairs),
        "n_poisoned": int((pairs.kind != 0).sum()),  # provenance: a clean fine-tuning source must have 0
        "shard_size": shard_size,
        "shards": [p.name for p in paths],
        "class_names": list(pairs.class_names),
        "image_shape": list(pairs.images.shape[1:]),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return paths


def clean_shard_count(n: int, shard_size: int, slots: int) -> int:
    """Shards for a clean fine-tuning set of ``n`` samples: ``ceil(n / shard_size)`` rounded up to a multiple of
    ``slots``, so that every stream slot gets a share however small the set.

    Raises:
        ValueError: fewer samples than slots (a slot would be empty).
    """
    if n < slots:
        raise ValueError(f"{n} clean fine-tuning samples cannot give each of {slots} stream slots a shard")
    return -(-max(1, -(-n // shard_size)) // slots) * slots


def clean_shard_size(n: int, shard_size: int, slots: int) -> int:
    """The largest shard of :func:`write_clean_shards`' split (at most ``shard_size``)."""
    return max(1, -(-n // clean_shard_count(n, shard_size, slots)))


def write_clean_shards(
    pairs: PairSet, out: Path, shard_size: int, slots: int, shuffle_seed=None
) -> list[Path]:
    """Write a clean fine-tuning set as exactly :func:`clean_shard_count` near-equal shards (prefix ``clean``)."""
    n_shards = clean_shard_count(len(pairs), shard_size, slots)
    size = clean_shard_size(len(pairs), shard_size, slots)
    return write_shards(pairs, out, size, prefix="clean", shuffle_seed=shuffle_seed, n_shards=n_shards)


def read_samples(path: Path, skip: Counter | None = None, on_bad: str = "skip") -> Iterator[dict]:
    """Decoded samples of one shard, in order (:func:`~.shard_reader.iter_shard`, webdataset's keys).

    Raises:
        ValueError: a sample without an image or a caption member (named with its shard and key).
    """
    for sample in iter_shard(path, skip, on_bad):
        yield _sample(sample, path)


def _sample(sample: dict, path: Path) -> dict:
    image, caption, meta = split_sample(sample)
    if image is None or caption is None:
        raise ValueError(
            f"{Path(path).name}: sample {sample['__key__']!r} lacks an image or a caption member "
            f"(has {sorted(parts(sample))})"
        )
    return {
        "key": sample["__key__"],
        "image": _decode_png(image),
        "caption": caption,
        "index": int(meta.get("index", -1)),
        "kind": int(meta.get("kind", 0)),
    }


class ShardStream(IterableDataset):
    """Stream samples (dicts: ``key``, ``image uint8 (C, H, W)``, ``caption``, ``index``, ``kind``) from shards.

    Args:
        shards: shard paths, or one folder / shard file / brace pattern (:func:`~.shard_reader.expand_shards`).
        rank, world_size: this process's share: shards ``rank::world_size`` (give every rank the same number of
            shards, e.g. shard count divisible by ``world_size``, or ranks see different step counts); ``None``
            (default): webdataset's ``split_by_node`` (``RANK``/``WORLD_SIZE`` or ``torch.distributed``).
        seed: with ``shuffle_buffer > 0`` or ``shuffle_shards``, the shuffling seed (mixed with the epoch).
        shuffle_shards: permute the shard order each epoch (same permutation on every rank).
        shuffle_buffer: samples held in a reservoir for local shuffling [ours; 0 = file order].
        on_bad: ``"skip"`` (count in :attr:`skipped`) or ``"error"`` for a corrupt or truncated shard.

    Within a DataLoader, worker ``w`` of ``W`` takes every ``W``-th of the rank's shards (webdataset's
    ``split_by_worker``).
    """

    def __init__(
        self,
        shards: list[Path] | Path | str,
        rank: int | None = None,
        world_size: int | None = None,
        seed: int = 0,
        shuffle_shards: bool = False,
        shuffle_buffer: int = 0,
        on_bad: str = "skip",
    ):
        super().__init__()
        self.shards = expand_shards(shards)
        if (rank is None) != (world_size is None):
            raise ValueError("give both rank and world_size, or neither (webdataset's split_by_node)")
        if rank is not None and not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.shuffle_shards, self.shuffle_buffer, self.on_bad = shuffle_shards, shuffle_buffer, on_bad
        self.epoch = 0
        self.skipped: Counter = Counter()  # in-process iteration only (a worker's copy is its own)

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch`` (call before creating the epoch's iterator)."""
        self.epoch = epoch

    def my_shards(self) -> list[Path]:
        """The shards this rank and (inside a DataLoader worker) this worker read, in reading order."""
        order = list(range(len(self.shards)))
        if self.shuffle_shards:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(order).tolist()
        if self.rank is None:
            order = list(split_by_node(order))
        else:
            order = order[self.rank :: self.world_size]
        return [self.shards[i] for i in split_by_worker(order)]

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        worker = 0 if info is None else info.id
        samples = (s for path in self.my_shards() for s in read_samples(path, self.skipped, self.on_bad))
        if self.shuffle_buffer <= 0:
            yield from samples
            return
        rng = np.random.default_rng([self.seed, self.epoch, self.rank or 0, worker])
        yield from buffered_shuffle(samples, self.shuffle_buffer, rng)


def buffered_shuffle(samples: Iterable, size: int, rng: np.random.Generator) -> Iterator:
    """Shuffle a stream through a ``size``-item buffer (webdataset's ``shuffle``): each incoming sample replaces
    a random buffered one, which is yielded; the rest are yielded shuffled at the end. Memory stays ``size``."""
    buffer: list = []
    for s in samples:
        if len(buffer) < size:
            buffer.append(s)
            continue
        j = int(rng.integers(len(buffer)))
        yield buffer[j]
        buffer[j] = s
    rng.shuffle(buffer)
    yield from buffer
