"""One CLIP trainer for the defenses ``none``, ``roclip``, ``safeclip`` and ``otcclip``, so that they differ
only where they must (same data order, augmentations, optimiser, schedule, model).

Per epoch ``e`` the defense picks a phase:

* none: ``clip`` (plain symmetric InfoNCE) every epoch.
* roclip [RoCLIP code]: ``roclip_match`` on matching epochs (caption embedding of each image replaced by
  its nearest bank caption, detached), ``clip`` otherwise.
* safeclip [SafeCLIP code, epochs scaled down, ours]: ``unimodal`` (two views per modality) for the first
  ``safeclip_unimodal_epochs``, then one ``clip`` epoch at ``lr * safeclip_clip_lr_scale``, then
  ``safe_split``: each epoch a 2-component Gaussian mixture on all pair cosines splits safe (CLIP loss) and
  risky (unimodal loss) pairs; the first split keeps p(clean) >= 0.9, later ones the top ``ratio`` by
  cosine, the ratio growing each epoch.
* otcclip [ours, brief §1.1]: ``otc`` = CLIP + lambda_inter inter-modality OT + lambda_intra
  intra-modality OT, and on matching epochs ``otc_match`` where captions are first re-assigned by
  global shortlist + OT re-ranking from the pool (global batch + bank).

Matching epochs (roclip and otcclip alike): ``e >= rematch_warmup`` and ``(e - rematch_warmup) %
rematch_every == 0``. Data order and augmentation noise come from generators seeded by (seed, epoch,
step) and are drawn for the whole global batch, so a multi-rank run sees exactly the same batches as a
single-process run (tested).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from reprlab.methods.otcclip.evaluate import embed_images, embed_texts
from reprlab.methods.otcclip.losses import OTConfig, clip_loss, ot_alignment, unimodal_loss
from reprlab.methods.otcclip.matching import CaptionBank, nn_rematch, otc_rematch
from reprlab.methods.otcclip.model import TextFeatures
from reprlab.methods.otcclip.mosaic import PairSet
from reprlab.methods.otcclip.tokenizer import WordTokenizer
from reprlab.train.dist import DistInfo, all_gather_nograd, all_gather_with_grad, average_gradients, shard

DEFENSES = ("none", "roclip", "safeclip", "otcclip")


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = field(default=12, metadata={"help": "training epochs per defense"})
    batch_size: int = field(default=128, metadata={"help": "global batch (split across ranks)"})
    lr: float = field(default=1e-3, metadata={"help": "peak AdamW learning rate"})
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW weight decay (RoCLIP: 0.1) on matrices"})
    warmup_steps: int = field(default=50, metadata={"help": "linear warm-up steps, then cosine decay"})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "final lr / peak lr"})
    grad_clip: float = field(default=1.0, metadata={"help": "gradient-norm clip"})
    shift: int = field(default=2, metadata={"help": "max random translation in px [ours: no flips/crops, "
                                                    "they would falsify 'left/right' captions]"})
    brightness: float = field(default=0.2, metadata={"help": "random brightness scale +- this"})
    word_dropout: float = field(default=0.1, metadata={"help": "EDA-style random word deletion probability"})


@dataclass(frozen=True)
class DefenseConfig:
    """Defense knobs. Every OTCCLIP value is [unknown] in the paper; defaults are ours (brief §2)."""

    bank_size: int = field(default=4096, metadata={"help": "FIFO caption bank (RoCLIP default 21,845)"})
    top_k: int = field(default=16, metadata={"help": "OTCCLIP shortlist size by global cosine"})
    alpha: float = field(default=0.5, metadata={"help": "S = alpha cos - (1 - alpha) D_OT"})
    rematch_every: int = field(default=2, metadata={"help": "period R of matching epochs (RoCLIP: 2)"})
    rematch_warmup: int = field(default=2, metadata={"help": "W epochs before the first matching epoch"})
    include_own: bool = field(default=True, metadata={"help": "[ours] the image's own caption is always an "
                                                             "OTCCLIP candidate and wins ties"})
    keep_margin: float = field(default=0.0, metadata={"help": "[ours] replace the own caption only when another "
                                                             "scores this much higher"})
    detach_matched_text: bool = field(default=True, metadata={"help": "[ours, following RoCLIP] on matching "
                                                                    "epochs the re-assigned captions' features are "
                                                                    "detached pool entries (no text gradient), so a "
                                                                    "wrong match cannot drag the text encoder"})
    lambda_inter: float = field(default=0.1, metadata={"help": "weight of the patch-token OT loss"})
    lambda_intra: float = field(default=0.1, metadata={"help": "weight of the view-view OT losses"})
    intra_subset: int = field(default=16, metadata={"help": "global samples per step given a second view for "
                                                           "the intra OT loss [ours: bounds its cost]"})
    ot: OTConfig = field(default_factory=OTConfig)
    safeclip_unimodal_epochs: int = field(default=2, metadata={"help": "SafeCLIP unimodal warm-up (paper: 5)"})
    safeclip_clip_lr_scale: float = field(default=0.01, metadata={"help": "lr scale of the one CLIP-on-all epoch "
                                                                         "(paper: 5e-6 vs 5e-4)"})
    safeclip_first_p: float = field(default=0.9, metadata={"help": "first split: p(clean) threshold"})
    safeclip_ratio_start: float = field(default=0.5, metadata={"help": "later splits: initial safe share [ours]"})
    safeclip_ratio_step: float = field(default=0.05, metadata={"help": "safe share growth per epoch (paper 0.01 "
                                                                      "over 32 epochs; ours scaled)"})
    safeclip_ratio_max: float = field(default=0.85, metadata={"help": "safe share cap (paper: 0.85)"})
    unimodal_temperature: float = field(default=0.1, metadata={"help": "in-modality InfoNCE temperature"})


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up then cosine to ``min_ratio``; a pure function of the step, so resume needs no state."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def augment_images(images: torch.Tensor, g: torch.Generator, shift: int, brightness: float) -> torch.Tensor:
    """Random translation (zero fill) and brightness of ``uint8 (B, C, H, W)`` -> float in [-1, 1]."""
    b, _, h, w = images.shape
    padded = F.pad(images.float(), (shift,) * 4)
    dx = torch.randint(0, 2 * shift + 1, (b,), generator=g).tolist()
    dy = torch.randint(0, 2 * shift + 1, (b,), generator=g).tolist()
    out = torch.stack([padded[i, :, dy[i] : dy[i] + h, dx[i] : dx[i] + w] for i in range(b)])
    scale = 1 + (torch.rand(b, 1, 1, 1, generator=g) * 2 - 1) * brightness
    return (out * scale).clamp(0, 255) / 127.5 - 1.0


def drop_words(ids: torch.Tensor, mask: torch.Tensor, g: torch.Generator, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Delete each word with probability p (at least one kept), re-packing left. ``(B, pos)`` each."""
    keep = mask & (torch.rand(ids.shape, generator=g) >= p)
    keep[:, 0] |= ~keep.any(1)
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)
    return torch.gather(ids * keep, 1, order), torch.gather(keep, 1, order)


class _State(nn.Module):
    """Per-pair trainer state kept in checkpoints (SafeCLIP's safe mask)."""

    def __init__(self, n: int):
        super().__init__()
        self.register_buffer("safe", torch.ones(n, dtype=torch.bool))


class Trainer:
    """Trains one model under one defense.

    Args:
        model: a TinyCLIP-like module (``encode_image``, ``encode_text``, ``scale``).
        data: training pairs (with provenance, used only for diagnostics, never by the defenses).
        tokenizer: caption tokenizer.
        defense: one of :data:`DEFENSES`.
        train, defense_cfg: settings.
        seed: data order / augmentation seed (identical on every rank).
        dist: rank info; the global batch is split contiguously across ranks.
    """

    def __init__(self, model, data: PairSet, tokenizer: WordTokenizer, defense: str, train: TrainConfig,
                 defense_cfg: DefenseConfig, seed: int, dist: DistInfo | None = None):
        if defense not in DEFENSES:
            raise ValueError(f"unknown defense {defense!r}; choose one of {DEFENSES}")
        self.model, self.data, self.defense = model, data, defense
        self.tcfg, self.dcfg, self.seed = train, defense_cfg, seed
        self.dist = dist or DistInfo()
        self.device = next(model.parameters()).device
        self.max_len = model.cfg.max_len
        self.tokenizer = tokenizer
        self.ids, self.mask = tokenizer.encode(data.captions, self.max_len)
        self.poison = data.kind != 0
        self.bank = CaptionBank(defense_cfg.bank_size, self.max_len, model.cfg.embed_dim).to(self.device)
        self.state = _State(len(data)).to(self.device)
        if train.batch_size > len(data):
            raise ValueError(f"batch_size {train.batch_size} exceeds the {len(data)} training pairs")
        shard(train.batch_size, self.dist.rank, self.dist.world_size)  # validates divisibility
        decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "pos" not in n and "cls" not in n]
        other = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "pos" not in n and "cls" not in n)]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": train.weight_decay},
                                      {"params": other, "weight_decay": 0.0}], lr=train.lr)
        self.steps_per_epoch = len(data) // train.batch_size
        self.examples: list[dict] = []

    # ------------------------------------------------------------------ schedule
    def is_match_epoch(self, epoch: int) -> bool:
        w, r = self.dcfg.rematch_warmup, self.dcfg.rematch_every
        return epoch >= w and (epoch - w) % r == 0

    def phase(self, epoch: int) -> str:
        if self.defense == "none":
            return "clip"
        if self.defense == "roclip":
            return "roclip_match" if self.is_match_epoch(epoch) else "clip"
        if self.defense == "otcclip":
            return "otc_match" if self.is_match_epoch(epoch) else "otc"
        u = self.dcfg.safeclip_unimodal_epochs
        return "unimodal" if epoch < u else ("clip_lowlr" if epoch == u else "safe_split")

    def modules(self) -> dict[str, nn.Module]:
        return {"model": self.model, "bank": self.bank, "state": self.state}

    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return {"opt": self.opt}

    # ------------------------------------------------------------------ epochs
    def run_epoch(self, epoch: int) -> dict:
        """Train one epoch; returns mean loss, phase and diagnostics (re-matching / split counts)."""
        phase = self.phase(epoch)
        stats = {"epoch": epoch, "phase": phase}
        if phase == "safe_split":
            stats.update(self._safeclip_split(epoch))
        order = torch.randperm(len(self.data), generator=torch.Generator().manual_seed(self.seed * 7919 + epoch))
        counts = torch.zeros(4, dtype=torch.long)  # poison, poison moved, clean, clean kept
        self._record = epoch == self._last_match_epoch()
        losses = []
        b = self.tcfg.batch_size
        for step in range(self.steps_per_epoch):
            idx = order[step * b : (step + 1) * b]
            loss, c = self.step(idx, epoch, step, phase)
            losses.append(loss)
            counts += c
        counts = all_gather_nograd(counts[None]).sum(0) if self.dist.enabled else counts
        stats["loss"] = float(np.mean(losses))
        if phase in ("roclip_match", "otc_match"):
            n_p, moved, n_c, kept = counts.tolist()
            stats.update(rematch_poison_moved=moved / max(n_p, 1), rematch_clean_kept=kept / max(n_c, 1),
                         n_poison_seen=n_p, n_clean_seen=n_c)
        return stats

    def _last_match_epoch(self) -> int:
        matches = [e for e in range(self.tcfg.epochs) if self.phase(e) in ("roclip_match", "otc_match")]
        return matches[-1] if matches else -1

    @torch.no_grad()
    def _safeclip_split(self, epoch: int) -> dict:
        """Fit the 2-component GMM to all pair cosines and set the safe mask (brief §4)."""
        from sklearn.mixture import GaussianMixture  # lazy: sklearn import is slow and only SafeCLIP needs it

        u = self.dcfg.safeclip_unimodal_epochs
        img = embed_images(self.model, self.data.images)
        txt = embed_texts(self.model, self.ids, self.mask)
        cos = (img * txt).sum(1).numpy().astype(np.float64)
        gmm = GaussianMixture(2, random_state=self.seed).fit(cos[:, None])
        clean = int(np.argmax(gmm.means_.ravel()))
        p_clean = gmm.predict_proba(cos[:, None])[:, clean]
        if epoch == u + 1:
            safe = p_clean >= self.dcfg.safeclip_first_p
        else:
            ratio = min(self.dcfg.safeclip_ratio_max,
                        self.dcfg.safeclip_ratio_start + self.dcfg.safeclip_ratio_step * (epoch - u - 2))
            safe = np.zeros(len(cos), bool)
            safe[np.argsort(-cos)[: max(1, int(round(ratio * len(cos))))]] = True
        safe_t = torch.from_numpy(safe)
        self.state.safe.copy_(safe_t.to(self.device))
        poison = self.poison
        return {"safe_share": float(safe_t.float().mean()),
                "poison_in_risky": float((~safe_t[poison]).float().mean()) if poison.any() else float("nan")}

    # ------------------------------------------------------------------ one step
    def step(self, idx: torch.Tensor, epoch: int, step: int, phase: str) -> tuple[float, torch.Tensor]:
        """One optimisation step on the global batch ``idx (batch,)``; returns (loss, match counts (4,))."""
        tc, dc, dev = self.tcfg, self.dcfg, self.device
        global_step = epoch * self.steps_per_epoch + step
        lr = tc.lr * lr_factor(global_step, tc.warmup_steps, tc.epochs * self.steps_per_epoch, tc.min_lr_ratio)
        if phase == "clip_lowlr":
            lr *= dc.safeclip_clip_lr_scale
        for group in self.opt.param_groups:
            group["lr"] = lr
        # augmentation noise for the whole global batch, identical on every rank
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch * 10_007 + step)
        view1 = augment_images(self.data.images[idx], g, tc.shift, tc.brightness)
        ids1, mask1 = drop_words(self.ids[idx], self.mask[idx], g, tc.word_dropout)
        view2 = augment_images(self.data.images[idx], g, tc.shift, tc.brightness)
        ids2, mask2 = drop_words(self.ids[idx], self.mask[idx], g, tc.word_dropout)
        # trim padding columns shared by the whole global batch (same on every rank)
        width = int(self.mask[idx].sum(1).max())
        ids1, mask1, ids2, mask2 = ids1[:, :width], mask1[:, :width], ids2[:, :width], mask2[:, :width]
        sl = shard(len(idx), self.dist.rank, self.dist.world_size)
        loc = idx[sl]
        v1, v2 = view1[sl].to(dev), view2[sl].to(dev)
        i1, m1, i2, m2 = ids1[sl].to(dev), mask1[sl].to(dev), ids2[sl].to(dev), mask2[sl].to(dev)
        counts = torch.zeros(4, dtype=torch.long)
        model, scale = self.model, self.model.scale()
        gather = all_gather_with_grad

        if phase in ("clip", "clip_lowlr"):
            img, txt = model.encode_image(v1), model.encode_text(i1, m1)
            loss = clip_loss(gather(img.global_), gather(txt.global_), scale)
            self._enqueue(i1, m1, txt, loc)
        elif phase == "roclip_match":
            img = model.encode_image(v1)
            with torch.no_grad():
                txt = model.encode_text(i1, m1)
            if len(self.bank) == 0:
                raise RuntimeError("RoCLIP matching epoch with an empty caption bank; set rematch_warmup >= 1")
            pool = self.bank.entries()
            match = nn_rematch(img.global_.detach(), pool["global_"])
            target = all_gather_nograd(pool["global_"][match.index])
            loss = clip_loss(gather(img.global_), target, scale)
            counts = self._count(loc, pool["sig"][match.index], pool["poison"][match.index])
            self._keep_examples(loc, pool["ids"][match.index])
            self._enqueue(i1, m1, txt, loc)
        elif phase in ("otc", "otc_match"):
            img = model.encode_image(v1)
            if phase == "otc_match":
                with torch.no_grad():
                    batch_txt = model.encode_text(i1, m1)
                pool = self._otc_pool(i1, m1, batch_txt, idx)
                own = torch.arange(sl.start, sl.stop, device=dev) if dc.include_own else None
                match = otc_rematch(img.global_.detach(), img.patches.detach(), pool["global_"], pool["tokens"],
                                    pool["mask"], dc.top_k, dc.alpha, dc.ot, own_index=own, margin=dc.keep_margin)
                ids_a, mask_a = pool["ids"][match.index], pool["mask"][match.index]
                counts = self._count(loc, pool["sig"][match.index], pool["poison"][match.index])
                self._keep_examples(loc, ids_a)
                if dc.detach_matched_text:
                    txt = TextFeatures(pool["global_"][match.index], pool["tokens"][match.index], mask_a)
                else:
                    txt = model.encode_text(ids_a, mask_a)
                self._enqueue(i1, m1, batch_txt, loc)
            else:
                txt = model.encode_text(i1, m1)
                self._enqueue(i1, m1, txt, loc)
            loss = clip_loss(gather(img.global_), gather(txt.global_), scale)
            if dc.lambda_inter > 0:
                loss = loss + dc.lambda_inter * ot_alignment(img.patches, txt.tokens, img.mask, txt.mask, dc.ot)
            if dc.lambda_intra > 0 and dc.intra_subset > 0:
                sub = self._intra_rows(len(idx))
                img2, txt_own = model.encode_image(v2[sub]), model.encode_text(i1[sub], m1[sub])
                txt2 = model.encode_text(i2[sub], m2[sub])
                intra = ot_alignment(img.patches[sub], img2.patches, None, None, dc.ot) + ot_alignment(
                    txt_own.tokens, txt2.tokens, txt_own.mask, txt2.mask, dc.ot)
                loss = loss + dc.lambda_intra * intra
        elif phase in ("unimodal", "safe_split"):
            a1, a2 = model.encode_image(v1), model.encode_image(v2)
            t1, t2 = model.encode_text(i1, m1), model.encode_text(i2, m2)
            ga1, ga2, gt1, gt2 = gather(a1.global_), gather(a2.global_), gather(t1.global_), gather(t2.global_)
            tau = dc.unimodal_temperature
            if phase == "unimodal":
                loss = unimodal_loss(ga1, ga2, tau) + unimodal_loss(gt1, gt2, tau)
            else:
                safe = self.state.safe[idx.to(dev)]
                loss = ga1.sum() * 0.0  # keeps the graph when one side is empty
                if safe.sum() >= 2:
                    loss = loss + clip_loss(ga1[safe], gt1[safe], scale)
                if (~safe).sum() >= 2:
                    loss = loss + unimodal_loss(ga1[~safe], ga2[~safe], tau) + unimodal_loss(gt1[~safe], gt2[~safe], tau)
        else:  # pragma: no cover - phase() only returns the names above
            raise AssertionError(phase)

        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        average_gradients(model)
        if tc.grad_clip > 0:
            nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        self.opt.step()
        return float(loss.detach()), counts

    def _intra_rows(self, n_global: int) -> torch.Tensor:
        """Local rows given a second view: every s-th global row, so ranks share the subset evenly."""
        stride = max(1, -(-n_global // self.dcfg.intra_subset))  # ceil: at most intra_subset rows
        sl = shard(n_global, self.dist.rank, self.dist.world_size)
        rows = torch.arange(sl.start, sl.stop)
        return (rows[rows % stride == 0] - sl.start).to(self.device)

    def _otc_pool(self, ids, mask, txt, idx) -> dict[str, torch.Tensor]:
        """Pool = this global batch's captions (gathered) + the bank, as one dict of tensors."""
        batch = {
            "ids": all_gather_nograd(ids), "mask": all_gather_nograd(mask),
            "global_": all_gather_nograd(txt.global_.detach()), "tokens": all_gather_nograd(txt.tokens.detach()),
            "sig": self.data.sig[idx].to(self.device), "poison": self.poison[idx].to(self.device),
        }
        pad = self.max_len - ids.shape[1]  # the batch was trimmed; the bank stores full-width rows
        for k in ("ids", "mask", "tokens"):
            widths = [0, 0] * (batch[k].dim() - 2) + [0, pad]
            batch[k] = F.pad(batch[k], widths)
        bank = self.bank.entries()
        return {k: torch.cat([batch[k], bank[k]]) for k in batch}

    def _enqueue(self, ids, mask, txt, loc) -> None:
        """Enqueue the global batch's captions (same on every rank, so banks stay identical)."""
        if self.defense not in ("roclip", "otcclip"):
            return
        self.bank.enqueue(all_gather_nograd(ids), all_gather_nograd(mask), all_gather_nograd(txt.global_.detach()),
                          all_gather_nograd(txt.tokens.detach()), self.data.sig[all_gather_nograd(loc)].to(self.device),
                          self.poison[all_gather_nograd(loc)].to(self.device))

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
                self.examples.append({"index": i, "kind": int(self.data.kind[i]), "original": self.data.captions[i],
                                      "reassigned": new_text[row]})
            if len(self.examples) >= 8:
                break
