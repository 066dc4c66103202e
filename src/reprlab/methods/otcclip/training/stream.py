"""Training from streamed image-caption data: webdataset-layout shards or a CSV/TSV/JSONL table of (image path,
caption) (:mod:`..data.sources`), read in slots by DataLoader workers (:mod:`.slots`), never all in RAM [ours].
Workers decode to the model's input size (:func:`~..data.transforms.model_transform`).

**Windows** [ours]. The trainer gathers ``window_batches`` rounds from all ranks into a window (uint8 images at
the model's input size plus token ids; memory = one window per rank), shuffles them with a generator seeded by
(seed, epoch, window) and trains on them exactly as the in-memory :class:`~.trainer.Trainer` trains on its
whole dataset: with one window covering the data, both trainers give bitwise-equal weights (tested). What a
defense does to "the dataset" happens per window: SafeCLIP-style splits fit their mixture / ratio on the
window's pair cosines, not on all pairs. OTCCLIP and RoCLIP-style re-matching need no change: their pool is
the global batch plus the FIFO caption bank, filled with features gathered from all ranks, which is already a
streaming structure (a larger ``defense.bank_size`` widens the pool; it never holds images).

**Clean fine-tuning source** [ours]. ``stream.clean_source`` (same formats as ``stream.source``) is CleanCLIP's
known-clean set on the streamed path, as ``data.clean_finetune_pairs`` is in memory: epochs whose phase is in the
defense's ``clean_phases`` stream it instead of ``stream.source``, through the same slots, workers and windows.
Such an epoch keeps the schedule's ``steps_per_epoch`` (the lr schedule is unchanged): the clean source is
streamed in passes until that many steps were taken, pass ``p > 0`` with the shard order and shuffle buffer
seeded by (seed, epoch, p), and window ``k`` of every pass permuted by the next draw of one generator seeded by
(seed, epoch, k). So with one window covering the clean set each pass is a fresh permutation drawn exactly as the
in-memory trainer cycles its clean set, and both give bitwise-equal weights (tested). Defenses without clean
phases never open it. A clean window holding an item whose provenance says poisoned stops training.
"""

from __future__ import annotations

from collections import Counter, deque

import torch
from torch.utils.data import DataLoader

from reprlab.errors import ConfigError, DataError
from reprlab.methods.otcclip.config import StreamConfig
from reprlab.methods.otcclip.data.sources import check_slots
from reprlab.methods.otcclip.data.transforms import model_transform
from reprlab.methods.otcclip.training.slots import SlotStream
from reprlab.methods.otcclip.training.trainer import Trainer
from reprlab.train.dist import all_gather_nograd


# ---------------------------------------------------------------------- the window
class Window:
    """One window of gathered samples, the ``data`` a streaming trainer trains on (the fields a defense
    reads of a :class:`~..data.pairs.PairSet`): ``images uint8 (n, C, S, S)``, ``sig``, ``kind`` ``(n,)``;
    ``captions`` decoded from the token ids on demand (examples only)."""

    def __init__(self, images, ids, mask, sig, kind, index, tokenizer):
        self.images, self.ids, self.mask = images, ids, mask
        self.sig, self.kind, self.index = sig, kind, index
        self.image_id = index
        self._tok = tokenizer

    def __len__(self) -> int:
        return len(self.images)

    @property
    def captions(self) -> list[str]:
        return self._tok.decode(self.ids)


class _NoState(torch.nn.Module):
    """The per-pair SafeCLIP mask of a window (rebuilt per window; never checkpointed)."""

    def __init__(self, n: int):
        super().__init__()
        self.register_buffer("safe", torch.ones(n, dtype=torch.bool))


class StreamTrainer(Trainer):
    """:class:`~.trainer.Trainer` over a stream (module docstring): same steps, defenses, bank and diagnostics,
    fed window by window.

    Args:
        model, tokenizer, defense, train, defense_cfg, seed, dist: as for the in-memory trainer.
        source: a :class:`ShardSource` or :class:`TableSource`.
        stream: slots, workers, window, shuffling and the schedule's sample count.
        n_samples: samples per epoch for the schedule (``stream.n_samples`` or a count of the source).
        clean: [ours] CleanCLIP's clean fine-tuning source (a :class:`ShardSource` or :class:`TableSource`,
            ``stream.clean_source``): streamed instead of ``source`` in the defense's ``clean_phases``, cycled to
            ``steps_per_epoch`` steps (module docstring); ignored by defenses without such phases; ``None``
            (default) streams ``source`` throughout, exactly as before.
    """

    in_memory = False

    def __init__(self, model, source, tokenizer, defense, train, defense_cfg, seed: int,
                 stream: StreamConfig, n_samples: int, dist=None, clean=None):  # fmt: skip
        self._setup(model, tokenizer, defense, train, defense_cfg, seed, dist)
        d, sc = self.dist, stream
        if train.batch_size % sc.slots:
            raise ConfigError(
                f"train.batch_size {train.batch_size} is not a multiple of stream.slots {sc.slots}"
            )
        if sc.slots % d.world_size:
            raise ConfigError(f"stream.slots {sc.slots} is not a multiple of the world size {d.world_size}")
        local = sc.slots // d.world_size
        # the data order depends on the slots only, so fewer workers change nothing but speed: take the largest
        # count <= num_workers that splits this rank's slots evenly (a rank with 1 slot gets 1 worker)
        self.num_workers = max((w for w in range(1, sc.num_workers + 1) if local % w == 0), default=0)
        # the clean source only where the defense trains on it: other defenses never open it (bit-identical)
        clean = clean if self.impl.clean_phases else None
        for key, src in (("stream.source", source), ("stream.clean_source", clean)):
            check_slots(src, key, sc.slots)
        self.scfg, self.source, self.clean_source = sc, source, clean
        slots = list(range(d.rank * local, (d.rank + 1) * local))
        self.local_slots = slots

        def slot_stream(src) -> SlotStream:
            return SlotStream(src, slots, sc.slots, train.batch_size // sc.slots, model_transform(model),
                              tokenizer, self.max_len, seed, sc.shuffle_shards, sc.shuffle_buffer,
                              sc.on_bad_sample)  # fmt: skip

        self.stream = slot_stream(source)
        self.clean_stream = slot_stream(clean) if clean is not None else None
        self.steps_per_epoch = max(1, n_samples // train.batch_size)  # the schedule's estimate
        self.data = Window(*(torch.zeros(0) for _ in range(6)), tokenizer)
        self.ids, self.mask, self.poison = self.data.ids, self.data.mask, self.data.kind
        self.state = _NoState(0)
        self.skipped: Counter = Counter()
        self._loader: DataLoader | None = None
        self._clean_loader: DataLoader | None = None

    def modules(self) -> dict[str, torch.nn.Module]:
        return {"model": self.model, "bank": self.bank}  # the window's SafeCLIP mask is rebuilt per window

    def global_batches(self, epoch: int, phase: str, stats: dict):
        """Windows of the stream, each shuffled and cut into global batches (module docstring). In the defense's
        clean phases with a clean source: that source, in passes until ``steps_per_epoch`` steps were taken."""
        clean = self.clean_stream is not None and phase in self.impl.clean_phases
        stream = self.clean_stream if clean else self.stream
        self.skipped = Counter()
        split: dict[str, list] = {}
        b, step, w, cycle = self.tcfg.batch_size, 0, 0, 0
        # one permutation generator per window position, kept across passes: pass 0 draws exactly the
        # pre-training rule's permutation, a later pass the generator's next one (as the in-memory trainer's cycling)
        gens: dict[int, torch.Generator] = {}
        while True:
            # before iter(): workers (new or persistent) read it when their iteration starts
            stream.set_epoch(epoch, cycle)
            loader = self._data_loader(clean)
            it, pending, ended = iter(loader), {s: deque() for s in self.local_slots}, set()
            first, k = step, 0
            while (window := self._next_window(it, pending, ended)) is not None:
                self._set_window(window)
                if clean and bool(self.poison.any()):
                    raise DataError(
                        f"the clean fine-tuning source {self.clean_source.name} holds poisoned items (provenance "
                        f"kind != 0) in epoch {epoch}; a clean fine-tuning set must be clean"
                    )
                n = len(self.data)
                start = self.impl.start_epoch(self, epoch, phase)
                for key, v in start.items():
                    split.setdefault(key, []).append((v, n))
                if "poison_in_risky" in start:  # exact over windows, not a mean of window shares
                    split.setdefault("_risky", []).append(
                        (int((~self.state.safe.cpu() & self.poison).sum()), int(self.poison.sum()))
                    )
                if k not in gens:
                    gens[k] = torch.Generator().manual_seed(self.seed * 7919 + epoch + 1_000_003 * k)
                order = torch.randperm(n, generator=gens[k])
                for j in range(n // b):
                    if clean and step == self.steps_per_epoch:
                        break
                    yield order[j * b : (j + 1) * b]
                    step += 1
                w, k = w + 1, k + 1
                if clean and step == self.steps_per_epoch:
                    break
            del it, loader  # ends non-persistent workers; persistent ones wait for the next epoch (or pass)
            # every item skipped: training on nothing would "succeed" with a NaN loss
            if not clean and step == 0:
                skipped = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in sorted(self.skipped.items()))
                raise DataError(
                    f"{self.source.name} gives no full global batch of {b} (train.batch_size) in "
                    f"{self.scfg.slots} slots: too few valid items (skipped before the epoch ended: "
                    f"{skipped or 'none'})",
                    hint="check the image paths (relative to the table's folder or stream.image_root) and the "
                    "shards; a smaller train.batch_size or stream.slots fits a small source",
                )
            if not clean or step == self.steps_per_epoch:
                break
            if step == first:  # would cycle forever
                raise DataError(
                    f"the clean fine-tuning source {self.clean_source.name} gives no full global batch of "
                    f"{b} (train.batch_size) in {self.scfg.slots} slots: too few valid items"
                )
            cycle += 1
        for key, vals in split.items():
            if not key.startswith("_"):
                stats[key] = float(sum(v * n for v, n in vals) / max(1, sum(n for _, n in vals)))
        if "_risky" in split:
            risky, n_p = (sum(x) for x in zip(*split["_risky"]))
            stats["poison_in_risky"] = risky / n_p if n_p else float("nan")
        stats["data_windows"] = w
        stats["data_steps"] = step
        if clean:
            stats["data_clean_passes"] = cycle + 1
        stats.update({f"data_skipped_{k}": v for k, v in sorted(self.skipped.items())})

    def _data_loader(self, clean: bool = False) -> DataLoader:
        """This epoch's loader of the training (or, ``clean``, the clean) stream: with ``stream.persistent_workers``
        (and workers) one loader per stream whose worker processes serve every epoch, else a new one (workers
        started and ended per epoch)."""
        stream = self.clean_stream if clean else self.stream
        if not (self.num_workers and self.scfg.persistent_workers):
            return DataLoader(stream, batch_size=None, num_workers=self.num_workers)
        attr = "_clean_loader" if clean else "_loader"
        if getattr(self, attr) is None:
            loader = DataLoader(
                stream, batch_size=None, num_workers=self.num_workers, persistent_workers=True
            )
            setattr(self, attr, loader)
        return getattr(self, attr)

    def _next_window(self, it, pending: dict, ended: set) -> dict | None:
        """Pull this rank's minibatches until every local slot has a window's worth (or ran out), agree with
        the other ranks on the number of complete rounds, gather them and put them in canonical order."""
        wb = self.scfg.window_batches

        def blocked() -> bool:
            return all(len(pending[s]) >= wb or s in ended for s in pending) or any(
                s in ended and len(pending[s]) < wb for s in pending
            )

        while not blocked():
            try:
                item = next(it)
            except StopIteration:
                ended.update(pending)
                break
            self.skipped.update(item["skipped"])
            if "error" in item:  # a worker met data that stops the run (module docstring of .slots)
                raise DataError(item["error"], hint=item.get("hint"))
            if item.get("end"):
                ended.add(item["slot"])
            else:
                pending[item["slot"]].append(item)
        rounds = torch.tensor([min(wb, *(len(p) for p in pending.values()))], device=self.device)
        if self.dist.enabled:
            torch.distributed.all_reduce(rounds, op=torch.distributed.ReduceOp.MIN)
        rounds = int(rounds)
        if rounds == 0:
            return None
        parts = [pending[s].popleft() for _ in range(rounds) for s in self.local_slots]
        n_slots = self.scfg.slots
        keys = torch.cat([torch.full((len(p["ids"]),), p["round"] * n_slots + p["slot"]) for p in parts])
        local = {
            k: torch.cat([p[k] for p in parts]) for k in ("images", "ids", "mask", "sig", "kind", "index")
        }
        local["mask"] = local["mask"].to(torch.uint8)  # gloo gathers no bool
        local["keys"] = keys
        if self.dist.enabled:
            local = {k: all_gather_nograd(v.to(self.device)).cpu() for k, v in local.items()}
        order = torch.argsort(local["keys"], stable=True)  # canonical: round-major, then slot
        out = {k: v[order] for k, v in local.items() if k != "keys"}
        out["mask"] = out["mask"].bool()
        return out

    def _set_window(self, window: dict) -> None:
        self.data = Window(window["images"], window["ids"], window["mask"], window["sig"], window["kind"],
                           window["index"], self.tokenizer)  # fmt: skip
        self.ids, self.mask = window["ids"], window["mask"]
        self.poison = window["kind"] != 0
        self.state = _NoState(len(self.data)).to(self.device)

    def _keep_examples(self, loc, new_ids) -> None:
        if not self._record or not self.dist.is_main or len(self.examples) >= 8:
            return
        n = len(self.examples)
        super()._keep_examples(loc, new_ids)
        for e in self.examples[n:]:  # a window position means nothing later: keep the image and dataset index
            e["image"] = self.data.images[e["index"]].tolist()
            e["index"] = int(self.data.index[e["index"]])
