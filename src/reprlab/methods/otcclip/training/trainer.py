"""One CLIP trainer for every defense, so that defenses differ only where they must (same data order,
augmentations, optimiser, schedule, model).

The trainer owns what defenses share: data order and augmentation noise, drawn from generators seeded by
(seed, epoch, step) for the whole global batch (so a multi-rank run sees exactly the same batches as a
single-process run, tested), the optimiser and learning-rate schedule, the FIFO caption bank's storage,
gradient averaging (DDP under torchrun), and the per-epoch diagnostics. What a defense does to the caption assignment and which
losses it adds lives in its own class under :mod:`..defenses` (``none``, ``roclip``, ``safeclip``, ``cleanclip``,
``otcclip``; see each module's docstring for its phases and sources); the trainer hands itself to the defense as
the :class:`~..defenses.base.TrainerView` it implements.

The data comes from :meth:`Trainer.global_batches`: here the whole in-memory :class:`PairSet`, permuted per
epoch; :class:`~.stream.StreamTrainer` overrides it to feed shards or a CSV/JSONL window
by window through DataLoader workers (with one window covering the data, both give bitwise-equal weights).

Logged per epoch: ``phase``, ``loss`` and ``loss_<term>`` (epoch means of the defense's named loss terms),
the defense's epoch-start stats (SafeCLIP: ``safe_share``, ``poison_in_risky``), and on matching epochs
``rematch_poison_moved``/``rematch_clean_kept`` (diagnostics from provenance, never seen by the defense) and,
when matching solved OT problems, ``ot_max_marginal_error`` and ``ot_converged_share``.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from reprlab.methods.otcclip.config import TrainConfig
from reprlab.methods.otcclip.data.pairs import PairSet
from reprlab.methods.otcclip.data.tokenizer import WordTokenizer
from reprlab.methods.otcclip.defenses import Batch, DefenseConfig, make_defense
from reprlab.methods.otcclip.defenses.matching import CaptionBank
from reprlab.methods.otcclip.training.augment import augment_images, drop_words
from reprlab.train.dist import DistInfo, all_gather_nograd, shard, wrap_ddp


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up then cosine to ``min_ratio``; a pure function of the step, so resume needs no state."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class _State(nn.Module):
    """Per-pair trainer state kept in checkpoints (SafeCLIP's and OTCCLIP's safe mask; with ``held``, OTCCLIP's
    ``flag_cohort`` pairs, which are never released)."""

    def __init__(self, n: int, held: bool = False, streak: bool = False):
        super().__init__()
        self.register_buffer("safe", torch.ones(n, dtype=torch.bool))
        if held:  # only then: checkpoints of runs without the cohort flag keep their keys
            self.register_buffer("held", torch.zeros(n, dtype=torch.bool))
        if streak:  # flag_cohort_persist > 1: cohort epochs in a row each pair has passed
            self.register_buffer("streak", torch.zeros(n, dtype=torch.int64))


class Trainer:
    """Trains one model under one defense.

    ``in_memory``: the whole training set is ``data`` (options that re-read every pair, such as OTCCLIP's
    ``match_schedule='epoch_start'``, need it); :class:`~.stream.StreamTrainer` holds one window at a time.

    Args:
        model: a TinyCLIP-like module (``encode_image``, ``encode_text``, ``scale``).
        data: training pairs (with provenance, used only for diagnostics, never by the defenses).
        tokenizer: caption tokenizer.
        defense: a registered defense name (see :data:`AVAILABLE_DEFENSES`).
        train, defense_cfg: settings.
        seed: data order / augmentation seed (identical on every rank).
        dist: rank info; the global batch is split contiguously across ranks.
        clean: [ours] a clean fine-tuning set (CleanCLIP's): epochs whose phase is in the defense's
            ``clean_phases`` draw their batches from it instead of ``data``, the same number of steps per epoch
            as pre-training (the set is cycled through fresh permutations, so the lr schedule is unchanged);
            ignored by defenses without such phases, and ``None`` (default) trains on ``data`` throughout.
    """

    in_memory = True

    def __init__(
        self,
        model,
        data: PairSet,
        tokenizer: WordTokenizer,
        defense: str,
        train: TrainConfig,
        defense_cfg: DefenseConfig,
        seed: int,
        dist: DistInfo | None = None,
        clean: PairSet | None = None,
    ):
        self._setup(model, tokenizer, defense, train, defense_cfg, seed, dist)
        self.data = data
        self.ids, self.mask = tokenizer.encode(data.captions, self.max_len)
        self.poison = data.kind != 0
        held = defense_cfg.flag != "none" and defense_cfg.flag_cohort_start >= 0
        streak = held and defense_cfg.flag_cohort_persist > 1
        self.state = _State(len(data), held=held, streak=streak).to(self.device)
        if train.batch_size > len(data):
            raise ValueError(f"batch_size {train.batch_size} exceeds the {len(data)} training pairs")
        self.steps_per_epoch = len(data) // train.batch_size
        self._sources = {"train": (data, self.ids, self.mask, self.poison)}
        if clean is not None and self.impl.clean_phases:
            if train.batch_size > len(clean):
                raise ValueError(
                    f"batch_size {train.batch_size} exceeds the {len(clean)} clean fine-tuning pairs"
                )
            if bool((clean.kind != 0).any()):
                raise ValueError("the clean fine-tuning set holds poisoned pairs")
            self._sources["clean"] = (clean, *tokenizer.encode(clean.captions, self.max_len), clean.kind != 0)

    def _use(self, phase: str) -> None:
        """Point ``data``/``ids``/``mask``/``poison`` at the set ``phase`` trains on (the clean fine-tuning set
        in the defense's ``clean_phases`` when one was given, else the training pairs)."""
        sources = getattr(self, "_sources", None)  # StreamTrainer has none
        if sources is None or "clean" not in sources:
            return
        key = "clean" if phase in self.impl.clean_phases else "train"
        self.data, self.ids, self.mask, self.poison = sources[key]

    def _setup(self, model, tokenizer, defense, train, defense_cfg, seed, dist) -> None:
        """What every trainer holds whatever its data: defense, model, bank, optimiser."""
        self.impl = make_defense(defense, defense_cfg)
        self.model, self.defense = model, defense
        self.tcfg, self.dcfg, self.seed = train, defense_cfg, seed
        self.dist = dist or DistInfo()
        self.device = next(model.parameters()).device
        self.max_len = model.cfg.max_len
        self.tokenizer = tokenizer
        self.bank = CaptionBank(
            defense_cfg.bank_size,
            self.max_len,
            model.cfg.embed_dim,
            # which training pair each slot's caption came from: what own_negatives and reassigned_weight compare
            track_loc=defense_cfg.own_negatives != "keep" or defense_cfg.reassigned_weight != 1.0,
        ).to(self.device)
        shard(train.batch_size, self.dist.rank, self.dist.world_size)  # validates divisibility
        decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "pos" not in n and "cls" not in n]
        other = [
            p for n, p in model.named_parameters() if not (p.ndim >= 2 and "pos" not in n and "cls" not in n)
        ]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": train.weight_decay}, {"params": other, "weight_decay": 0.0}],
            lr=train.lr,
        )
        self.examples: list[dict] = []
        self._record = False
        # under torchrun: DDP reduces the gradients in buckets overlapped with backward; the step's forward
        # (every encoder call of the defense) runs inside one DDP forward (reprlab.train.dist.StepModule)
        self.ddp = wrap_ddp(model, find_unused_parameters=self.impl.partial_grad)

    # ------------------------------------------------------------------ schedule
    def is_match_epoch(self, epoch: int) -> bool:
        return self.impl.is_match_epoch(epoch)

    def phase(self, epoch: int) -> str:
        return self.impl.phase(epoch)

    def modules(self) -> dict[str, nn.Module]:
        return {"model": self.model, "bank": self.bank, "state": self.state}

    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return {"opt": self.opt}

    # ------------------------------------------------------------------ epochs
    def run_epoch(self, epoch: int) -> dict:
        """Train one epoch; returns mean loss (and terms), phase and the defense's diagnostics."""
        phase = self.phase(epoch)
        self._use(phase)
        stats = {"epoch": epoch, "phase": phase}
        counts = torch.zeros(4, dtype=torch.long)  # poison, poison moved, clean, clean kept
        self._record = epoch == self._last_match_epoch()
        losses, terms, ot_err, ot_conv = [], {}, [], []
        for step, idx in enumerate(self.global_batches(epoch, phase, stats)):
            out = self.step(idx, epoch, step, phase)
            losses.append(out.loss)
            for k, v in out.terms.items():
                terms.setdefault(k, []).append(v)
            if out.assignment is not None:
                counts += self._count(out.batch_loc, out.assignment.sig, out.assignment.poison)
                self._keep_examples(out.batch_loc, out.assignment.ids)
                if out.assignment.ot_marginal_error is not None:
                    ot_err.append(float(out.assignment.ot_marginal_error.max()))
                    ot_conv.append(out.assignment.ot_converged.float().mean().item())
        counts = all_gather_nograd(counts[None]).sum(0) if self.dist.enabled else counts
        stats["loss"] = float(np.mean(losses))
        stats.update({f"loss_{k}": float(np.mean(v)) for k, v in terms.items()})
        if self.dist.enabled:  # OT terms are means over this rank's rows: log the global batch's mean
            keys = ["loss", *(f"loss_{k}" for k in terms)]
            vals = torch.tensor([stats[k] for k in keys], dtype=torch.float64, device=self.device)
            torch.distributed.all_reduce(vals)
            stats.update(zip(keys, (vals / self.dist.world_size).tolist()))
        if phase in self.impl.match_phases:
            n_p, moved, n_c, kept = counts.tolist()
            stats.update(
                rematch_poison_moved=moved / max(n_p, 1),
                rematch_clean_kept=kept / max(n_c, 1),
                n_poison_seen=n_p,
                n_clean_seen=n_c,
            )
        if ot_err:
            stats.update(ot_max_marginal_error=max(ot_err), ot_converged_share=float(np.mean(ot_conv)))
            tol = self.dcfg.ot.match_tol
            if tol is not None and max(ot_err) > tol:
                warnings.warn(
                    f"{self.defense} epoch {epoch}: re-matching OT did not converge: largest marginal "
                    f"error {max(ot_err):.2e} > match_tol {tol:g} ({1 - np.mean(ot_conv):.1%} of "
                    "problems); raise defense.ot.match_max_iters or eps",
                    RuntimeWarning,
                    stacklevel=2,
                )
        return stats

    def global_batches(self, epoch: int, phase: str, stats: dict):
        """The epoch's global batches as index tensors ``(batch,)`` into ``self.data``; runs the defense's
        epoch-start action first and adds its stats to ``stats``."""
        stats.update(self.impl.start_epoch(self, epoch, phase))
        g = torch.Generator().manual_seed(self.seed * 7919 + epoch)
        b, n = self.tcfg.batch_size, len(self.data)
        # whole batches of one permutation; only a clean fine-tuning set smaller than the training pairs
        # needs more than one (so no batch holds an item twice)
        chunks = [torch.randperm(n, generator=g)[: n // b * b]]
        while sum(map(len, chunks)) < self.steps_per_epoch * b:
            chunks.append(torch.randperm(n, generator=g)[: n // b * b])
        order = torch.cat(chunks)
        for step in range(self.steps_per_epoch):
            yield order[step * b : (step + 1) * b]

    def _last_match_epoch(self) -> int:
        matches = [e for e in range(self.tcfg.epochs) if self.phase(e) in self.impl.match_phases]
        return matches[-1] if matches else -1

    # ------------------------------------------------------------------ one step
    def batch(self, idx: torch.Tensor, epoch: int, step: int, phase: str) -> Batch:
        """Augmented views and word-dropout captions of the global batch ``idx``; this rank's rows."""
        tc, dev = self.tcfg, self.device
        # augmentation noise for the whole global batch, identical on every rank
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch * 10_007 + step)
        sl = shard(len(idx), self.dist.rank, self.dist.world_size)
        images = self.data.images[idx]
        view1 = augment_images(images, g, tc.shift, tc.brightness, rows=sl, device=dev)
        keep = getattr(self.tokenizer, "special_ids", ())  # SOT/EOT (BOS/EOS) are never dropped
        ids1, mask1 = drop_words(self.ids[idx], self.mask[idx], g, tc.word_dropout, keep)
        view2 = augment_images(images, g, tc.shift, tc.brightness, rows=sl, device=dev)
        ids2, mask2 = drop_words(self.ids[idx], self.mask[idx], g, tc.word_dropout, keep)
        # trim padding columns shared by the whole global batch (same on every rank)
        width = int(self.mask[idx].sum(1).max())
        ids1, mask1, ids2, mask2 = ids1[:, :width], mask1[:, :width], ids2[:, :width], mask2[:, :width]
        return Batch(
            idx,
            sl,
            idx[sl],
            view1,
            view2,
            ids1[sl].to(dev),
            mask1[sl].to(dev),
            ids2[sl].to(dev),
            mask2[sl].to(dev),
            epoch,
            step,
            phase,
        )

    def step(self, idx: torch.Tensor, epoch: int, step: int, phase: str) -> _StepResult:
        """One optimisation step on the global batch ``idx (batch,)``."""
        tc = self.tcfg
        global_step = epoch * self.steps_per_epoch + step
        lr = tc.lr * lr_factor(
            global_step, tc.warmup_steps, tc.epochs * self.steps_per_epoch, tc.min_lr_ratio
        )
        lr *= self.impl.lr_scale(phase)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self._use(phase)
        b = self.batch(idx, epoch, step, phase)
        out = self.impl.step(self, b) if self.ddp is None else self.ddp(self.impl.step, self, b)
        self.opt.zero_grad(set_to_none=True)
        out.loss.backward()  # under DDP: returns with the gradients averaged over ranks
        if tc.grad_clip > 0:
            nn.utils.clip_grad_norm_(self.model.parameters(), tc.grad_clip)
        self.opt.step()
        return _StepResult(float(out.loss.detach()), out.terms, out.assignment, b.loc)

    # ------------------------------------------------------------------ services for defenses
    def intra_rows(self, n_global: int) -> torch.Tensor:
        """Local rows given a second view: every s-th global row, so ranks share the subset evenly."""
        stride = max(1, -(-n_global // self.dcfg.intra_subset))  # ceil: at most intra_subset rows
        sl = shard(n_global, self.dist.rank, self.dist.world_size)
        rows = torch.arange(sl.start, sl.stop)
        return (rows[rows % stride == 0] - sl.start).to(self.device)

    def enqueue(self, ids, mask, txt, loc) -> None:
        """Enqueue the global batch's captions (same on every rank, so banks stay identical); a no-op for
        defenses without a bank."""
        if not self.impl.uses_bank:
            return
        pairs = all_gather_nograd(loc)  # the global batch's training pairs, rank by rank
        self.bank.enqueue(
            all_gather_nograd(ids),
            all_gather_nograd(mask),
            all_gather_nograd(txt.global_.detach()),
            all_gather_nograd(txt.tokens.detach()),
            self.data.sig[pairs].to(self.device),
            self.poison[pairs].to(self.device),
            loc=pairs.to(self.device),
        )

    # ------------------------------------------------------------------ diagnostics
    def _count(self, loc, new_sig, new_poison) -> torch.Tensor:
        """[poison, poison moved away from poison captions, clean, clean kept on a same-content caption]."""
        own_sig, poison = self.data.sig[loc], self.poison[loc]
        new_sig, new_poison = new_sig.cpu(), new_poison.cpu()
        moved = poison & ~new_poison & (new_sig != own_sig)
        kept = ~poison & (new_sig == own_sig)
        return torch.stack([poison.sum(), moved.sum(), (~poison).sum(), kept.sum()])

    def _keep_examples(self, loc, new_ids) -> None:
        """Remember a few (image, original caption, re-assigned caption) triples of the last matching epoch."""
        if not self._record or not self.dist.is_main or len(self.examples) >= 8:
            return
        new_text = self.tokenizer.decode(new_ids.cpu())
        for row in range(len(loc)):
            i = int(loc[row])
            want_poison = sum(e["kind"] != 0 for e in self.examples) < 5
            if (self.poison[i] and want_poison) or (not self.poison[i] and len(self.examples) < 3):
                self.examples.append(
                    {
                        "index": i,
                        "kind": int(self.data.kind[i]),
                        "original": self.data.captions[i],
                        "reassigned": new_text[row],
                    }
                )
            if len(self.examples) >= 8:
                break


@dataclass
class _StepResult:
    """What :meth:`Trainer.step` reports: the loss value, its terms, the assignment and this rank's rows."""

    loss: float
    terms: dict[str, float]
    assignment: object
    batch_loc: torch.Tensor
