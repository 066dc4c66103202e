"""Caption re-matching: OTCCLIP's OT re-ranking and RoCLIP's nearest-neighbour matching.

OTCCLIP (all details ours: the abstract names OT re-matching, not its form): for each image i, take the top-k
captions by global cosine from the pool (current global batch + FIFO bank, captions stored with their token
features), score
S_ij = alpha cos(u_i, w_j) - (1 - alpha) D(V_i, T_j) with D the entropic OT distance between patch and
token features, and assign pi(i) = argmax_j S_ij. No gradient flows through matching.

RoCLIP [``BigML-CS-UCLA/RoCLIP``]: each image's caption embedding is replaced by the caption embedding in
the bank with maximum cosine to the image embedding; the bank is queried before the batch is enqueued.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from reprlab.methods.otcclip.config import DefenseConfig, OTConfig
from reprlab.methods.otcclip.data.transforms import to_input
from reprlab.methods.otcclip.defenses.losses import ot_solve
from reprlab.methods.otcclip.models.features import TextFeatures
from reprlab.ot import SinkhornResult


class CaptionBank(nn.Module):
    """FIFO bank of captions with their detached features, kept as buffers so checkpoints carry it.

    Args:
        capacity: number of captions kept.
        max_len: ``pos`` of stored token ids.
        dim: joint embedding ``d``.
    """

    def __init__(self, capacity: int, max_len: int, dim: int, track_loc: bool = False):
        super().__init__()
        self.capacity = capacity
        if (
            track_loc
        ):  # [ours] the training pair each slot's caption came from (-1 unknown), checkpointed with the
            # bank so a resumed run recognises the same bank copies (OTCCLIP ``own_negatives``); off by default so
            # other runs' checkpoints keep their keys
            self.register_buffer("loc", torch.full((capacity,), -1, dtype=torch.long))
        self.register_buffer("ids", torch.zeros(capacity, max_len, dtype=torch.long))
        self.register_buffer("mask", torch.zeros(capacity, max_len, dtype=torch.bool))
        self.register_buffer("global_", torch.zeros(capacity, dim))
        self.register_buffer("tokens", torch.zeros(capacity, max_len, dim))
        self.register_buffer("sig", torch.full((capacity,), -1, dtype=torch.long))
        self.register_buffer("poison", torch.zeros(capacity, dtype=torch.bool))
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def __len__(self) -> int:
        return int(self.count)

    @torch.no_grad()
    def enqueue(self, ids, mask, global_, tokens, sig, poison, loc=None) -> None:
        """Append a batch (oldest entries are overwritten); all arguments have leading dim ``batch``. ``loc``: the
        training pairs the captions came from, recorded when the bank tracks them (``track_loc``)."""
        n = min(len(ids), self.capacity)
        ids, mask, global_, tokens, sig, poison = (t[-n:] for t in (ids, mask, global_, tokens, sig, poison))
        slots = (self.ptr + torch.arange(n, device=self.ptr.device)) % self.capacity
        if loc is not None and hasattr(self, "loc"):
            self.loc[slots] = loc[-n:]
        pos = ids.shape[1]
        self.ids[slots] = 0
        self.mask[slots] = False
        self.tokens[slots] = 0
        self.ids[slots, :pos], self.mask[slots, :pos] = ids, mask
        self.global_[slots], self.tokens[slots, :pos] = global_.detach(), tokens.detach()
        self.sig[slots], self.poison[slots] = sig, poison
        self.ptr.copy_((self.ptr + n) % self.capacity)
        self.count.copy_(torch.clamp(self.count + n, max=self.capacity))

    def entries(self) -> dict[str, torch.Tensor]:
        """The filled part: dict of ``ids, mask, global_, tokens, sig, poison`` with leading dim ``len(self)``."""
        n = len(self)
        return {k: getattr(self, k)[:n] for k in ("ids", "mask", "global_", "tokens", "sig", "poison")}


class PoolRows:
    """Rows of ``first`` followed by rows of ``second``, gathered on indexing without concatenating them.

    [ours, speed] The OTCCLIP pool is this batch's captions plus the bank; concatenating the bank's token
    features (2048 x 32 x 64 floats, 17 MB) every step only to read the shortlisted rows cost more than
    the shortlist itself. ``first`` may be narrower than ``second`` in dim 1 (the trimmed batch): its rows
    are zero-padded on the right, exactly as concatenation after padding would give.
    """

    def __init__(self, first: torch.Tensor, second: torch.Tensor):
        self.first, self.second = first, second

    def __len__(self) -> int:
        return len(self.first) + len(self.second)

    def __getitem__(self, index: torch.Tensor) -> torch.Tensor:
        return self.take(index)

    def take(self, index: torch.Tensor, width: int | None = None) -> torch.Tensor:
        """Rows ``index``, optionally only their first ``width`` entries of dim 1 (saves the copy)."""
        n1 = len(self.first)
        width = self.second.shape[1] if width is None else width
        out = self.second.new_zeros((len(index), width, *self.second.shape[2:]))
        in_first = index < n1
        picked = self.first[index[in_first], :width]
        out[in_first, : picked.shape[1]] = picked
        out[~in_first] = self.second[index[~in_first] - n1, :width]
        return out


def used_width(mask: torch.Tensor) -> int:
    """``1 +`` the last column of ``bool (rows, pos)`` that is valid in some row (``pos`` if none is)."""
    cols = torch.nonzero(mask.any(0)).flatten()
    return int(cols.max()) + 1 if len(cols) else mask.shape[1]


# [ours, speed] see pool_text_features; False = the plain no-grad forward in training mode (the old path).
POOL_EVAL_FORWARD = True


@torch.no_grad()
def pool_text_features(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor):
    """``model.encode_text(ids, mask)`` without gradient: the features a batch's own captions enter the pool with.

    [ours, speed] When the model's forward does not depend on its training mode (no dropout with p > 0, no
    batch norm), the forward runs in eval mode, where torch's transformer layers take their fused inference
    path: the same values up to float rounding (1e-7 on TinyCLIP; tested), 4.1 vs 5.9 ms for 50 captions on
    TinyCLIP (1 thread). The training mode is restored afterwards.
    """
    if not (POOL_EVAL_FORWARD and model.training and _mode_independent(model)):
        return model.encode_text(ids, mask)
    model.eval()
    try:
        return model.encode_text(ids, mask)
    finally:
        model.train()


def _mode_independent(model: nn.Module) -> bool:
    """True when no submodule behaves differently in train and eval mode (dropout p > 0, batch norm)."""
    for mod in model.modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm):
            return False
        if isinstance(mod, nn.modules.dropout._DropoutNd) and mod.p > 0:
            return False
        rate = getattr(mod, "dropout", None)  # MultiheadAttention and HF attention keep a float rate
        if isinstance(rate, float) and rate > 0:
            return False
    return True


@dataclass
class MatchResult:
    """``index (batch,)`` into the pool; ``score (batch,)`` of the chosen caption; ``ot (batch, k)`` distances;
    ``ot_result`` the solver's output for the problems it solved (``batch * k``, less the duplicates
    ``otc_rematch`` skips); ``marginal_error`` and ``converged`` ``(batch, k)``: its diagnostics per candidate
    (a skipped duplicate carries those of the problem it duplicates)."""

    index: torch.Tensor
    score: torch.Tensor
    ot: torch.Tensor | None = None
    ot_result: SinkhornResult | None = None
    marginal_error: torch.Tensor | None = None
    converged: torch.Tensor | None = None


# [ours, speed] With the own caption added in column 0, an image whose own caption is also shortlisted would
# solve the same problem twice; the duplicate is not solved and takes column 0's distance (it can never win:
# column 0 wins ties and the margin only lowers the others). Same choice and distances; False = solve both.
SKIP_OWN_DUPLICATE = True


@torch.no_grad()
def otc_rematch(
    image_global: torch.Tensor,
    patches: torch.Tensor,
    pool_global: torch.Tensor,
    pool_tokens: torch.Tensor,
    pool_mask: torch.Tensor,
    top_k: int,
    alpha: float,
    ot: OTConfig,
    patch_mask: torch.Tensor | None = None,
    own_index: torch.Tensor | None = None,
    margin: float = 0.0,
) -> MatchResult:
    """OTCCLIP re-matching.

    Args:
        image_global: ``(batch, d)`` normalised u_i.
        patches: ``(batch, n, d)`` normalised patch features V_i.
        pool_global: ``(P, d)`` caption embeddings w_j; pool_tokens ``(P, m, d)``; pool_mask ``bool (P, m)``
            (tokens and mask may be any object whose indexing with a ``(rows,)`` index tensor gives those rows,
            e.g. :class:`PoolRows`, so the pool need not be concatenated).
        top_k: shortlist size k (clipped to P).
        alpha: weight of the global cosine against the OT distance.
        ot: solver settings.
        patch_mask: optional ``bool (batch, n)``.
        own_index: optional ``(batch,)`` pool index of each image's current caption. [ours] When given,
            the own caption is always a candidate (even outside the shortlist), wins ties, and is replaced
            only by a caption scoring more than ``margin`` higher.
        margin: see ``own_index``.
    """
    batch, n, d = patches.shape
    k = min(top_k, len(pool_global))
    sims = image_global @ pool_global.T  # [batch, P]
    top_sim, top_idx = sims.topk(k, dim=1)  # [batch, k]
    if own_index is not None:  # own caption in column 0 (duplicates in the shortlist are harmless)
        top_idx = torch.cat([own_index[:, None], top_idx], dim=1)
        top_sim = torch.cat([sims.gather(1, own_index[:, None]), top_sim], dim=1)
        k += 1
    xm = None if patch_mask is None else patch_mask[:, None].expand(batch, k, n).reshape(batch * k, n)
    flat = top_idx.reshape(-1)
    mask = pool_mask[flat]
    # [ours, speed] drop the columns that are padding in every candidate (the bank stores full-width rows):
    # they carry zero mass, so the distances are unchanged, and the OT problems shrink to the longest caption
    width = used_width(mask)
    if isinstance(pool_tokens, PoolRows):
        tokens = pool_tokens.take(flat, width)
    else:
        tokens = pool_tokens[flat][:, :width]
    # [ours, speed] the k problems of an image share its patches: their cosine costs come from one product
    # per image, (n, d) x (d, k * width), instead of copying the patches k times into (batch * k, n, d)
    # problems; the solver only reads the shape of the expanded (never materialised) patch tensor.
    cost = _shared_patch_cost(patches, k)
    solve = None  # (batch * k,) bool: the problems solved (None: all)
    if own_index is not None and SKIP_OWN_DUPLICATE:
        dup = torch.zeros_like(top_idx, dtype=torch.bool)
        dup[:, 1:] = top_idx[:, 1:] == top_idx[:, :1]
        if bool(dup.any()):
            solve = ~dup.reshape(-1)
            cost = _subset_cost(cost, tokens, solve)
    pick = slice(None) if solve is None else solve
    n_solve = batch * k if solve is None else int(solve.sum())
    x = patches.new_zeros(()).expand(n_solve, n, d)
    xm_s = None if xm is None else xm[pick]
    solved = ot_solve(x, tokens[pick], xm_s, mask[pick, :width], ot, matching=True, cost=cost)
    err, conv = solved.marginal_error, solved.converged
    if solve is None:
        dist = solved.cost.view(batch, k)
    else:  # a skipped duplicate is column 0's problem
        dist, err_full, conv_full = (
            torch.zeros(batch * k, dtype=v.dtype, device=v.device) for v in (solved.cost, err, conv)
        )
        dist[solve], err_full[solve], conv_full[solve] = solved.cost, err, conv
        dist, err, conv = dist.view(batch, k), err_full.view(batch, k), conv_full.view(batch, k)
        dups = ~solve.view(batch, k)
        for t in (dist, err, conv):
            t[dups] = t[:, :1].expand(batch, k)[dups]
    score = alpha * top_sim - (1 - alpha) * dist
    if own_index is not None and margin > 0:
        score = torch.cat([score[:, :1], score[:, 1:] - margin], dim=1)
    best = score.argmax(dim=1)  # first maximum: the own caption wins ties
    rows = torch.arange(batch, device=best.device)
    return MatchResult(
        top_idx[rows, best],
        alpha * top_sim[rows, best] - (1 - alpha) * dist[rows, best],
        dist,
        solved,
        err.view(batch, k),
        conv.view(batch, k),
    )


def _subset_cost(full_cost, tokens: torch.Tensor, solve: torch.Tensor):
    """Cost builder for the problems ``solve (batch * k,)`` only: ``full_cost`` (a :func:`_shared_patch_cost`)
    on all candidates ``tokens``, then those rows (the shared products are cheap next to the solve)."""

    def cost(_x: torch.Tensor, _y: torch.Tensor) -> torch.Tensor:
        return full_cost(None, tokens)[solve]

    return cost


def _shared_patch_cost(patches: torch.Tensor, k: int):
    """Cost builder for ``k`` candidates per image: ``(x, y) -> 1 - cos`` of shape ``(batch * k, n, m)``,
    where ``y (batch * k, m, d)`` holds the candidates image by image and ``x`` is ignored (it stands for the
    patches repeated k times). Same values as :func:`reprlab.ot.costs.cosine_cost` up to rounding."""
    pn = F.normalize(patches, dim=-1)

    def cost(_x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        batch, n, d = pn.shape
        m = y.shape[1]
        yn = F.normalize(y, dim=-1).reshape(batch, k * m, d)
        cos = torch.bmm(pn, yn.transpose(1, 2))  # (batch, n, k * m)
        out = cos.view(batch, n, k, m).transpose(1, 2).reshape(batch * k, n, m)
        return out.neg_().add_(1.0).clamp_(0.0, 2.0)

    return cost


@torch.no_grad()
def nn_rematch(image_global: torch.Tensor, pool_global: torch.Tensor) -> MatchResult:
    """RoCLIP: the pool caption with maximum cosine to each image. ``(batch, d)``, ``(P, d)`` -> index ``(batch,)``."""
    score, index = (image_global @ pool_global.T).max(dim=1)
    return MatchResult(index, score)


@torch.no_grad()
def rematch_whole_set(
    model: nn.Module,
    images: torch.Tensor,
    ids: torch.Tensor,
    mask: torch.Tensor,
    cfg: DefenseConfig,
    device: torch.device,
    chunk: int = 256,
    rows: torch.Tensor | None = None,
    pool: torch.Tensor | None = None,
) -> dict:
    """OTCCLIP re-matching of every training pair at once (``match_schedule='epoch_start'`` [ours]): images
    ``uint8 (N, C, H, W)`` and captions ``ids``/``mask (N, pos)`` encoded un-augmented in chunks, each image
    re-matched over all N captions. Returns ``index (N,)`` into the captions, their features ``txt`` and the OT
    diagnostics ``err``/``conv (N, k)``.

    ``rows``: only these images ``(R,)`` (``index``, ``err`` and ``conv`` then have R rows); ``pool``: offer only
    these captions ``(P,)``, with no own caption kept by ``include_own``'s margin (the flag probe's question: which
    accepted caption would a flagged image get). ``index`` stays an index into the N captions.
    """
    c, dev = cfg, device
    rows = torch.arange(len(ids)) if rows is None else rows.cpu()
    imgs = [model.encode_image(to_input(images[r]).to(dev)) for r in rows.split(chunk)]
    txts = [
        model.encode_text(ids[s : s + chunk].to(dev), mask[s : s + chunk].to(dev))
        for s in range(0, len(ids), chunk)
    ]
    g = torch.cat([t.global_ for t in txts])
    tokens, pool_mask = torch.cat([t.tokens for t in txts]), torch.cat([t.mask for t in txts])
    offered = (g, tokens, pool_mask) if pool is None else (g[pool], tokens[pool], pool_mask[pool])
    index, err, conv = [], [], []
    for r, img in zip(rows.split(chunk), imgs):
        own = r.to(dev) if c.include_own and pool is None else None
        m = otc_rematch(
            img.global_,
            img.patches,
            *offered,
            c.top_k,
            c.alpha,
            c.ot,
            own_index=own,
            margin=c.keep_margin,
        )
        index.append(m.index if pool is None else pool.to(dev)[m.index])
        err.append(m.marginal_error)
        conv.append(m.converged)
    return {
        "index": torch.cat(index),
        "txt": TextFeatures(g, tokens, pool_mask),
        "err": torch.cat(err),
        "conv": torch.cat(conv),
    }
