"""OTCCLIP [ours: the paper's abstract names OT re-matching and OT alignment losses, not their form].

Every epoch trains ``L = L_CLIP(i, pi(i)) + lambda_inter D(V_i, T_pi(i)) + lambda_intra [D(V_i, V_i') +
D(T_i, T_i')]`` (phase ``otc``). On matching epochs (phase ``otc_match``) the captions are first re-assigned:
pi(i) = argmax over the pool (this global batch + the FIFO bank) of S_ij = alpha cos(u_i, w_j) - (1 - alpha)
D(V_i, T_j), with a global-cosine top-k shortlist and [ours] the own caption kept unless beaten by
``keep_margin``. The re-assigned captions are the ones trained on (by default as detached pool features);
``matched_text`` [ours] chooses how: ``pool`` (every image trains on its assigned pool caption), ``kept_grad``
(images that keep their own caption train it with text gradient) or ``drop`` (as ``kept_grad``, and images
whose caption was re-assigned leave the cross-modal losses for that step).

Options against the within-epoch feedback loop of re-matching [ours; docs/otcclip_ablation.md]:
``own_negatives`` masks the own caption (or exact-duplicate captions) out of the negatives of its image,
``reassigned_weight`` down-weights the cross-modal terms of re-assigned pairs, and ``match_schedule='epoch_start'``
fixes the assignment for a whole matching epoch from the epoch-start model (these three need the in-memory
trainer: :func:`~..config.whole_set.whole_set_options`).

``flag='consensus'`` [ours]: pairs flagged by neighbour consensus leave the CLIP and inter-OT terms
(:mod:`.consensus` has the score, the flagging schedule and the flagged pairs' in-modality loss).
"""

from __future__ import annotations

import warnings

import torch

from reprlab.errors import ConfigError
from reprlab.methods.otcclip.config import whole_set_options
from reprlab.methods.otcclip.defenses.base import Assignment, Batch, Defense, StepOutput, register
from reprlab.methods.otcclip.defenses.consensus import batch_flags, flag_terms, update_flags
from reprlab.methods.otcclip.defenses.copies import CopyWeights
from reprlab.methods.otcclip.defenses.losses import clip_loss, ot_alignment, ot_alignments
from reprlab.methods.otcclip.defenses.matching import (
    PoolRows,
    otc_rematch,
    pool_text_features,
    rematch_whole_set,
    used_width,
)
from reprlab.methods.otcclip.defenses.options import check_options
from reprlab.methods.otcclip.models.features import (
    ImageFeatures,
    TextFeatures,
    cat_padded,
    merge_rows,
    split_rows,
    trim,
)
from reprlab.train.dist import all_gather_nograd, all_gather_with_grad

# [ours, speed; part of reuse_own_text] on matching epochs (matched_text='pool', fused encoders) the pool's
# features of the intra term's own-caption rows are that term's (detached) instead of a second, gradient-free
# encode of the same rows: 1/4 of the batch's captions fewer per step at the defaults. Same values up to
# rounding (tested); False = the pool encodes every own caption (the step before this switch).
POOL_SKIPS_INTRA_ROWS = True


@register
class OTCCLIP(Defense):
    name = "otcclip"
    uses_bank = True
    match_phases = ("otc_match",)
    check = staticmethod(check_options)

    def __init__(self, cfg):
        super().__init__(cfg)
        check_options(cfg)
        self._fixed = None  # the epoch-start assignment (match_schedule='epoch_start'), per matching epoch
        self.copies = CopyWeights(cfg.copies_hash)  # copies_weight's per-pair weights, computed on first use

    def phase(self, epoch: int) -> str:
        return "otc_match" if self.cfg.rematch and self.is_match_epoch(epoch) else "otc"

    def lr_scale(self, phase: str) -> float:
        return self.cfg.match_lr_scale if phase == "otc_match" else 1.0

    # ---------------------------------------------------------------- feedback-loop options [ours]
    def _pair_key(self, tr, loc: torch.Tensor) -> torch.Tensor:
        """Caption key of training pairs ``loc`` (-1 stays -1): the pair itself (``mask_own``) or the id of its
        raw caption text (``mask_text``: equal ids = identical token ids before word dropout)."""
        if self.cfg.own_negatives == "mask_own":
            return loc
        key = getattr(self, "_text_key", None)
        if key is None:
            key = self._text_key = torch.unique(tr.ids, dim=0, return_inverse=True)[1]
        out = torch.full_like(loc, -1)
        known = loc >= 0
        out[known] = key.to(loc.device)[loc[known]]
        return out

    def _negative_mask(self, tr, b: Batch, assigned_loc: torch.Tensor | None) -> torch.Tensor | None:
        """``bool (global, global)``: logit (i, j) is masked when pair j trains on a caption with image i's own
        caption key (i != j). ``assigned_loc (local,)``: the training pair each image's trained-on caption came
        from (its own on non-matching epochs)."""
        if self.cfg.own_negatives == "keep":
            return None
        own = b.idx.to(tr.device)
        got = own if assigned_loc is None else all_gather_nograd(assigned_loc.to(tr.device))
        k_own, k_got = self._pair_key(tr, own), self._pair_key(tr, got)
        mask = (k_own[:, None] == k_got[None, :]) & (k_got[None, :] >= 0)
        return mask & ~torch.eye(len(own), dtype=torch.bool, device=mask.device)

    @torch.no_grad()
    def start_epoch(self, tr, epoch: int, phase: str) -> dict:
        """``match_schedule='epoch_start'``: re-match every training pair once, with the epoch-start model, over
        all training captions (un-augmented), and keep that assignment for the epoch's steps."""
        self._fixed = None
        if not tr.in_memory and (opts := whole_set_options(self.cfg)):
            raise ConfigError(f"{', '.join(opts)} needs the in-memory trainer (a stream indexes one window)")
        stats = update_flags(self.cfg, tr, epoch)
        if phase != "otc_match" or self.cfg.match_schedule != "epoch_start":
            return stats
        self._fixed = rematch_whole_set(tr.model, tr.data.images, tr.ids, tr.mask, self.cfg, tr.device)
        own_kept = (self._fixed["index"] == torch.arange(len(tr.ids), device=tr.device)).float().mean()
        return {**stats, "epoch_start_own_kept": float(own_kept)}

    def assign_fixed(self, tr, b: Batch) -> tuple[Assignment, TextFeatures]:
        """The epoch-start assignment of this rank's pairs (``match_schedule='epoch_start'``)."""
        c, f = self.cfg, self._fixed
        loc = b.loc.to(f["index"].device)
        i = f["index"][loc]
        mask_a = f["txt"].mask[i]
        w = used_width(mask_a) if c.fused_ot_losses else mask_a.shape[1]
        ids_a, mask_a = tr.ids[i.cpu()].to(tr.device)[:, :w], mask_a[:, :w]
        if c.detach_matched_text:
            txt = TextFeatures(f["txt"].global_[i], f["txt"].tokens[i][:, :w], mask_a)
        else:
            txt = tr.model.encode_text(ids_a, mask_a)
        # no enqueue: with the epoch-start schedule every matching epoch re-matches from start_epoch, so nothing
        # reads the bank
        ic = i.cpu()
        sig, poison = tr.data.sig[ic].to(tr.device), tr.poison[ic].to(tr.device)  # diagnostics only
        return Assignment(i, ids_a, sig, poison, f["err"][loc].flatten(), f["conv"][loc].flatten()), txt

    # ---------------------------------------------------------------- caption assignment
    def pool(self, tr, b: Batch, txt: TextFeatures) -> dict:
        """Candidates = this global batch's captions (gathered, rows 0..batch-1) + the bank.

        ``global_``, ``sig`` and ``poison`` are concatenated tensors; ``ids``, ``mask`` and ``tokens`` are
        :class:`PoolRows` (indexing gives full-width rows, the batch part zero-padded as the bank stores it).
        """
        batch = {
            "ids": all_gather_nograd(b.ids1),
            "mask": all_gather_nograd(b.mask1),
            "global_": all_gather_nograd(txt.global_.detach()),
            "tokens": all_gather_nograd(txt.tokens.detach()),
            "sig": tr.data.sig[b.idx].to(tr.device),
            "poison": tr.poison[b.idx].to(tr.device),
        }
        bank = tr.bank.entries()
        lazy = ("ids", "mask", "tokens")
        return {
            k: PoolRows(batch[k], bank[k]) if k in lazy else torch.cat([batch[k], bank[k]]) for k in batch
        }

    def _pool_batch_text(self, tr, b: Batch, sub: torch.Tensor, own_sub: TextFeatures) -> TextFeatures:
        """The pool's features of this rank's own captions ``b.ids1``: rows ``sub`` from ``own_sub`` (already
        encoded, with gradient; taken detached), the others from a gradient-free forward. Same values as
        encoding every row without gradient, up to rounding (tested)."""
        rest = torch.ones(len(b.ids1), dtype=torch.bool, device=b.ids1.device)
        rest[sub] = False
        other = pool_text_features(tr.model, b.ids1[rest], b.mask1[rest])
        glob = other.global_.new_empty((len(b.ids1), *other.global_.shape[1:]))
        tokens = other.tokens.new_empty((len(b.ids1), *other.tokens.shape[1:]))
        glob[rest], tokens[rest] = other.global_, other.tokens
        glob[sub], tokens[sub] = own_sub.global_.detach(), own_sub.tokens.detach()
        return TextFeatures(glob, tokens, b.mask1)

    def assign(
        self, tr, b: Batch, img: ImageFeatures, batch_txt: TextFeatures | None = None
    ) -> tuple[Assignment, TextFeatures]:
        """Re-match this rank's images over the pool; returns the assignment and the text features to train on.
        Sets ``self._assigned_loc`` (local,): the training pair each assigned caption came from (-1 unknown).
        ``batch_txt``: the pool's (gradient-free) features of the own captions ``b.ids1``, when the step already
        has them; otherwise they are encoded here."""
        c = self.cfg
        n_batch = len(b.idx)
        bank_loc = getattr(tr.bank, "loc", None)
        if batch_txt is None:
            batch_txt = pool_text_features(tr.model, b.ids1, b.mask1)  # no gradient (eval-mode forward)
        pool = self.pool(tr, b, batch_txt)
        own = torch.arange(b.rows.start, b.rows.stop, device=tr.device) if c.include_own else None
        match = otc_rematch(
            img.global_.detach(),
            img.patches.detach(),
            pool["global_"],
            pool["tokens"],
            pool["mask"],
            c.top_k,
            c.alpha,
            c.ot,
            own_index=own,
            margin=c.keep_margin,
        )
        i = match.index
        ids_a, mask_a = pool["ids"][i], pool["mask"][i]
        pool_loc = b.idx.to(tr.device)[
            i.clamp(max=n_batch - 1)
        ]  # batch part: its pairs; bank part: the mirror
        in_bank = i >= n_batch
        if in_bank.any():
            slots = (i[in_bank] - n_batch).cpu()
            pool_loc[in_bank] = (bank_loc[slots] if bank_loc is not None else torch.full_like(slots, -1)).to(
                tr.device
            )
        self._assigned_loc = pool_loc
        # [ours, speed, part of fused_ot_losses] pool rows are full width; padding-only columns carry no mass
        w = used_width(mask_a) if c.fused_ot_losses else mask_a.shape[1]
        if c.detach_matched_text:
            txt = TextFeatures(pool["global_"][i], pool["tokens"].take(i, w), mask_a[:, :w])
        else:
            txt = tr.model.encode_text(ids_a[:, :w], mask_a[:, :w])
        tr.enqueue(b.ids1, b.mask1, batch_txt, b.loc)  # after the query: the pool's batch part is explicit
        err = None if match.marginal_error is None else match.marginal_error.flatten()
        conv = None if match.converged is None else match.converged.flatten()
        return Assignment(i, ids_a, pool["sig"][i], pool["poison"][i], err, conv), txt

    # ---------------------------------------------------------------- losses
    def losses(
        self,
        tr,
        b: Batch,
        img: ImageFeatures,
        txt: TextFeatures,
        own_txt: TextFeatures | None = None,
        views: tuple | None = None,
        keep: torch.Tensor | None = None,
        negative_mask: torch.Tensor | None = None,
        row_weight: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Unweighted loss terms: ``clip``, ``ot_inter`` (patches vs assigned tokens), ``ot_intra`` (view vs view),
        and, when an OT loss was solved, its diagnostics ``ot_marginal_error`` (largest L1 marginal error of the
        step's solves) and ``ot_iters`` (iterations run); the trainer logs them as epoch means
        (``loss_ot_marginal_error``, ``loss_ot_iters``), and :meth:`step` warns once per epoch when the epoch's
        largest error is above ``ot.loss_tol``.

        ``own_txt``: the own captions' first-view features with gradient, when already computed (non-matching
        epochs: they are ``txt``); the intra text term then reuses its rows instead of encoding them again.
        ``views``: the intra term's ``(second image view, own captions, caption views)`` features of the
        :meth:`~.base.TrainerView.intra_rows`, when the step already encoded them.
        ``keep``: optional ``bool (local,)``; only these rows enter the CLIP and inter-OT terms
        (``matched_text='drop'``). The CLIP term then contrasts the kept rows of the whole global batch.
        ``negative_mask``: optional ``bool (global, global)`` logits left out of the CLIP term
        (``own_negatives``); ``row_weight``: optional ``(global,)`` weights of each pair's CLIP and inter-OT terms
        (``reassigned_weight``).
        """
        c, model = self.cfg, tr.model
        img_g, txt_g = all_gather_with_grad(img.global_), all_gather_with_grad(txt.global_)
        inter = (img.patches, txt.tokens, img.mask, txt.mask)
        inter_w = None if row_weight is None else row_weight[b.rows]
        if keep is not None:
            kept_global = all_gather_nograd(keep.to(torch.uint8)).bool()
            img_g, txt_g = img_g[kept_global], txt_g[kept_global]
            inter = tuple(t[keep] for t in inter)
            if negative_mask is not None:
                negative_mask = negative_mask[kept_global][:, kept_global]
            if row_weight is not None:
                row_weight, inter_w = row_weight[kept_global], inter_w[keep]
        zero = img.global_.sum() * 0.0  # a term with no rows: 0, still attached to the graph
        clip = clip_loss(img_g, txt_g, model.scale(), negative_mask, row_weight) if len(img_g) else zero
        terms = {"clip": clip}
        groups: list[tuple[str, tuple]] = []
        diag: list = []  # SinkhornResults of the loss OT solves
        if c.lambda_inter > 0:
            if len(inter[0]) == 0:
                terms["ot_inter"] = zero
            elif c.fused_ot_losses:
                groups.append(("ot_inter", inter))
            else:  # solved here, before the intra encodes: the old graph order, bitwise-identical weights
                terms["ot_inter"] = ot_alignment(*inter, c.ot, diag, inter_w)
        if c.lambda_intra > 0 and c.intra_subset > 0:
            sub = tr.intra_rows(len(b.idx))
            if views is not None:
                img2, txt_own, txt2 = views
            else:
                img2 = model.encode_image(b.view2[sub])
                if own_txt is not None:  # same rows, same widths: the encoder is deterministic (no dropout)
                    txt_own = TextFeatures(own_txt.global_[sub], own_txt.tokens[sub], own_txt.mask[sub])
                else:
                    txt_own = model.encode_text(b.ids1[sub], b.mask1[sub])
                txt2 = model.encode_text(b.ids2[sub], b.mask2[sub])
            groups.append(("ot_intra_image", (img.patches[sub], img2.patches, None, None)))
            groups.append(("ot_intra_text", (txt_own.tokens, txt2.tokens, txt_own.mask, txt2.mask)))
        if groups:
            if c.fused_ot_losses:
                weights = [inter_w if name == "ot_inter" else None for name, _ in groups]
                values = ot_alignments(
                    [g for _, g in groups], c.ot, diag, weights if inter_w is not None else None
                )
            else:
                values = [ot_alignment(*g, c.ot, diag) for _, g in groups]
            parts = dict(zip([name for name, _ in groups], values))
            if "ot_inter" in parts:
                terms["ot_inter"] = parts["ot_inter"]
            if "ot_intra_image" in parts:
                terms["ot_intra"] = parts["ot_intra_image"] + parts["ot_intra_text"]
        if diag:  # the loss OT solves' diagnostics: largest L1 marginal error and iterations of this step
            terms["ot_marginal_error"] = torch.tensor(max(float(r.marginal_error.max()) for r in diag))
            terms["ot_iters"] = torch.tensor(float(max(r.n_iters for r in diag)))
        return terms

    def step(self, tr, b: Batch) -> StepOutput:
        c, model = self.cfg, tr.model
        intra = c.lambda_intra > 0 and c.intra_subset > 0
        fuse = c.fused_encoders and intra
        sub = tr.intra_rows(len(b.idx)) if fuse else None
        views = None  # the intra term's (second image view, own caption, caption view), when pre-encoded
        if fuse:  # [ours, speed] the second views ride along in the first views' forward passes
            img, img2 = split_rows(model.encode_image(torch.cat([b.view1, b.view2[sub]])), len(b.view1))
        else:
            img = model.encode_image(b.view1)
        assignment, keep, own_grad = None, None, None
        self._assigned_loc = None
        if b.phase == "otc_match" and self._fixed is not None:  # match_schedule='epoch_start'
            assignment, txt = self.assign_fixed(tr, b)
            self._assigned_loc = assignment.index
            if fuse:
                ids, mask = cat_padded([b.ids1[sub], b.ids2[sub]], [b.mask1[sub], b.mask2[sub]])
                views = (img2, *split_rows(model.encode_text(ids, mask), len(sub)))
        elif b.phase == "otc_match":
            pool_txt = None
            if fuse and c.matched_text == "pool" and c.reuse_own_text and POOL_SKIPS_INTRA_ROWS:
                # [ours, speed] the intra term's own captions (with gradient) are encoded first; the pool takes
                # them detached and encodes only the other rows without gradient
                ids, mask = cat_padded([b.ids1[sub], b.ids2[sub]], [b.mask1[sub], b.mask2[sub]])
                views = (img2, *split_rows(model.encode_text(ids, mask), len(sub)))
                pool_txt = self._pool_batch_text(tr, b, sub, views[1])
            assignment, txt = self.assign(tr, b, img, pool_txt)
            if c.matched_text != "pool":  # [ours] kept own captions train with text gradient
                kept = assignment.index == torch.arange(b.rows.start, b.rows.stop, device=tr.device)
                if fuse:
                    ids, mask = cat_padded([b.ids1, b.ids2[sub]], [b.mask1, b.mask2[sub]])
                    own_grad, txt2 = split_rows(model.encode_text(ids, mask), len(b.ids1))
                    own_grad = trim(own_grad, b.ids1.shape[1])
                    views = (
                        img2,
                        TextFeatures(own_grad.global_[sub], own_grad.tokens[sub], own_grad.mask[sub]),
                        txt2,
                    )
                else:
                    own_grad = model.encode_text(b.ids1, b.mask1)
                txt = merge_rows(kept, own_grad, txt)
                keep = kept if c.matched_text == "drop" else None
            elif fuse and views is None:
                # the own captions were encoded without gradient for the pool: encode both views here
                ids, mask = cat_padded([b.ids1[sub], b.ids2[sub]], [b.mask1[sub], b.mask2[sub]])
                views = (img2, *split_rows(model.encode_text(ids, mask), len(sub)))
        elif fuse:
            ids, mask = cat_padded([b.ids1, b.ids2[sub]], [b.mask1, b.mask2[sub]])
            txt, txt2 = split_rows(model.encode_text(ids, mask), len(b.ids1))
            txt = trim(txt, b.ids1.shape[1])
            views = (img2, TextFeatures(txt.global_[sub], txt.tokens[sub], txt.mask[sub]), txt2)
        else:
            txt = model.encode_text(b.ids1, b.mask1)
        if assignment is None:
            tr.enqueue(b.ids1, b.mask1, txt, b.loc)
        own = txt if assignment is None else own_grad  # the own captions' features with gradient, if any
        neg = self._negative_mask(tr, b, self._assigned_loc)
        row_w = self.copies.rows(tr, b.idx) if c.copies_weight else None
        # [ours] re-assigned: another pair's caption
        if assignment is not None and c.reassigned_weight != 1.0:
            moved = all_gather_nograd(self._assigned_loc) != b.idx.to(tr.device)
            moved_w = torch.where(moved, c.reassigned_weight, 1.0).to(img.global_.dtype)
            row_w = moved_w if row_w is None else row_w * moved_w
        flagged = batch_flags(tr, b) if c.flag != "none" else None
        if flagged is not None:
            keep = ~flagged if keep is None else keep & ~flagged
        terms = self.losses(tr, b, img, txt, own if c.reuse_own_text else None, views, keep, neg, row_w)
        terms.update(flag_terms(c, tr, b, img, own, flagged))
        loss = terms["clip"]
        if "ot_inter" in terms:
            loss = loss + c.lambda_inter * terms["ot_inter"]
        if "ot_intra" in terms:
            loss = loss + c.lambda_intra * terms["ot_intra"]
        if "inmodal" in terms:
            loss = loss + terms["inmodal"]
        if "unlearn" in terms:
            loss = loss + c.flagged_unlearn * terms["unlearn"]
        if "ot_marginal_error" in terms:
            self._note_loss_ot(tr, b, float(terms["ot_marginal_error"]))
        return StepOutput(loss, {k: float(v.detach()) for k, v in terms.items()}, assignment)

    def _note_loss_ot(self, tr, b: Batch, err: float) -> None:
        """Warn once, at an epoch's last step, when its largest loss-OT marginal error is above ``ot.loss_tol``."""
        worst = err if b.step == 0 else max(err, getattr(self, "_loss_ot_worst", 0.0))
        self._loss_ot_worst = worst
        tol, last = self.cfg.ot.loss_tol, getattr(tr, "steps_per_epoch", None)
        if tol is not None and last is not None and b.step == last - 1 and worst > tol:
            warnings.warn(
                f"otcclip epoch {b.epoch}: training-loss OT did not converge: largest marginal error "
                f"{worst:.2e} > loss_tol {tol:g}; raise defense.ot.loss_max_iters or eps",
                RuntimeWarning,
                stacklevel=3,
            )
