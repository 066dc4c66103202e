"""The worker-side half of streamed training: a rank's slots of a source, as minibatches [ours].

**Slots.** The data is split into ``slots`` logical sub-streams: a shard source gives slot ``s`` the shards
``order[s::slots]`` (``order`` permuted per epoch with ``shuffle_shards``), a table gives it rows ``i`` with
``i % slots == s`` (:mod:`..data.sources`). Each slot yields minibatches of ``batch_size / slots`` samples (after
an optional per-slot shuffle buffer seeded by (seed, epoch, slot)); global round ``j`` is the concatenation of
every slot's ``j``-th minibatch in slot order. Ranks own contiguous blocks of slots and DataLoader workers split a
rank's slots, so the sequence of global rounds depends on ``slots`` only, not on the number of ranks or workers
(tested: 2 torchrun ranks against one process). An epoch ends when the first slot runs out (the rest is
dropped, like ``drop_last``); give slots equal shares (shard count a multiple of ``slots``).

Bad items (unreadable or missing image, missing/empty/over-long/non-UTF-8 caption, unparsable row or JSON, an
unreadable or truncated shard) are skipped and counted per reason; the trainer logs the counts per epoch as
``data_skipped_<reason>`` (their sums over epochs go to the summary). With ``on_bad="error"``
(``stream.on_bad_sample``) a corrupt image or shard stops the run instead. Such an error, and a refused shard
(unsafe member names), never raises inside a DataLoader worker: the worker yields ``{"slot", "error", "hint"}``
and the trainer raises it as a :class:`~reprlab.errors.DataError` in the main process.
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from reprlab.errors import DataError
from reprlab.methods.otcclip.data import shards as sh
from reprlab.methods.otcclip.data.datasets import MAX_CAPTION_CHARS
from reprlab.methods.otcclip.data.shard_reader import BadSampleError
from reprlab.methods.otcclip.data.transforms import ImageTransform


class SlotStream(IterableDataset):
    """Minibatches of one rank's slots (module docstring). Each item is a dict: ``slot``, ``round``,
    ``images uint8 (m, C, S, S)``, ``ids``/``mask (m, max_len)``, ``sig``/``kind``/``index (m,)``, ``skipped``
    (counts per reason since the previous item, a plain dict); or ``{"slot": s, "end": True}`` once slot ``s``
    has no full minibatch left; or ``{"slot": s, "error": message, "hint": fix}`` when the data must stop the run."""

    def __init__(self, source, slots: list[int], n_slots: int, per_slot: int, transform: ImageTransform,
                 tokenizer, max_len: int, seed: int, shuffle_shards: bool, shuffle_buffer: int,
                 on_bad: str = "skip"):  # fmt: skip
        super().__init__()
        self.on_bad = on_bad
        self.source, self.slots, self.n_slots, self.per_slot = source, slots, n_slots, per_slot
        self.transform, self.tokenizer, self.max_len = transform, tokenizer, max_len
        self.seed, self.shuffle_shards, self.shuffle_buffer = seed, shuffle_shards, shuffle_buffer
        # shared memory: persistent DataLoader workers hold a copy of this dataset made when they started, and
        # read the epoch from here each time an epoch's iteration starts
        self._epoch = torch.zeros((), dtype=torch.long).share_memory_()
        self._cycle = torch.zeros((), dtype=torch.long).share_memory_()  # the pass over a cycled clean source

    @property
    def epoch(self) -> int:
        return int(self._epoch)

    @property
    def cycle(self) -> int:
        return int(self._cycle)

    def set_epoch(self, epoch: int, cycle: int = 0) -> None:
        self._epoch.fill_(epoch)
        self._cycle.fill_(cycle)

    def _samples(self, slot: int, skip: Counter) -> Iterator[tuple[torch.Tensor, str, dict]]:
        for name, image, caption, meta in self.source.items(
            slot, self.n_slots, self.seed, self.epoch, self.shuffle_shards, skip, self.cycle
        ):
            if caption is None:
                skip["missing_caption"] += 1
                continue
            if not caption.strip():
                skip["empty_caption"] += 1
                continue
            if len(caption) > MAX_CAPTION_CHARS:
                skip["caption_too_long"] += 1
                continue
            if image is None or (isinstance(image, Path) and not image.exists()):
                skip["missing_image"] += 1
                continue
            try:
                pixels = self.transform(image)
            except Exception as err:  # PIL raises many types for corrupt files
                if self.on_bad == "error":
                    raise BadSampleError(
                        f"{name}: unreadable image ({type(err).__name__}: {err})",
                        hint="remove or re-encode it, or set stream.on_bad_sample=skip to skip and count it",
                    ) from err
                skip["unreadable_image"] += 1
                continue
            yield pixels, caption.strip(), meta

    def _shuffled(self, slot: int, skip: Counter):
        samples = self._samples(slot, skip)
        if self.shuffle_buffer <= 0:
            yield from samples
            return
        key = [self.seed, self.epoch, slot, 17] + ([self.cycle] if self.cycle else [])
        rng = np.random.default_rng(key)
        yield from sh.buffered_shuffle(samples, self.shuffle_buffer, rng)

    def _batch(self, slot: int, rnd: int, rows: list, skip: Counter) -> dict:
        ids, mask = self.tokenizer.encode([c for _, c, _ in rows], self.max_len)
        meta = [m for _, _, m in rows]
        out = {
            "slot": slot,
            "round": rnd,
            "images": torch.stack([p for p, _, _ in rows]),
            "ids": ids,
            "mask": mask,
            "sig": torch.tensor([int(m["sig"]) if "sig" in m else caption_sig(c) for _, c, m in rows]),
            "kind": torch.tensor([int(m.get("kind", 0)) for m in meta]),
            "index": torch.tensor([int(m.get("index", -1)) for m in meta]),
            "skipped": dict(skip),  # a dict: DataLoader's default_convert re-adds a Counter's counts
        }
        skip.clear()
        return out

    def __iter__(self):
        try:
            yield from self._rounds()
        except DataError as err:  # delivered to the main process as an item, not as a worker crash
            yield {"slot": -1, "error": str(err), "hint": err.hint, "skipped": {}}

    def _rounds(self):
        info = get_worker_info()
        mine = self.slots if info is None else self.slots[info.id :: info.num_workers]
        skips = {s: Counter() for s in mine}
        streams = {s: self._shuffled(s, skips[s]) for s in mine}
        rnd = 0
        while True:
            for s in mine:
                rows = [r for _, r in zip(range(self.per_slot), streams[s])]
                if len(rows) < self.per_slot:
                    # a worker stops with its first exhausted slot: the epoch ends there anyway
                    for t in mine:
                        yield {"slot": t, "end": True, "skipped": dict(skips[t])}
                    return
                yield self._batch(s, rnd, rows, skips[s])
            rnd += 1


def caption_sig(caption: str) -> int:
    """Content id of a caption without provenance: equal ids = the same caption text (case-insensitive), as the
    audit loader groups them; only re-matching diagnostics read it."""
    return zlib.crc32(caption.lower().encode("utf-8")) & 0x7FFFFFFF
