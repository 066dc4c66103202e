"""Training objectives.

* ``clip_loss``: symmetric InfoNCE [CLIP; RoCLIP/SafeCLIP code]: logits s_ij = exp(t) cos(u_i, w_j),
  loss = 1/2 [CE(rows) + CE(columns)] with diagonal targets.
* ``ot_alignment``: mean OT distance D(X_i, Y_i) between paired feature sets, with the plan detached
  (envelope gradient) [OTCCLIP abstract: "OT-based fine-grained alignment"; formula ours, as the paper's
  method section is not public].
  Inter-modality: D(V_i, T_pi(i)) (patches vs tokens). Intra-modality: D(V_i, V_i') + D(T_i, T_i') for two
  augmented views.
* ``unimodal_loss``: in-modality InfoNCE between two views [SafeCLIP's unimodal CL; ours: the batch
  as negatives instead of SafeCLIP's 256-entry nearest-neighbour bank].
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from reprlab.methods.otcclip.config import OTConfig
from reprlab.ot import SinkhornResult, ot_distance
from reprlab.ot.distance import grouped_cosine_ot, pad_groups

# [ours, speed] ot_alignments (Sinkhorn) builds its cosine costs and envelope gradient in one autograd node
# (reprlab.ot.distance.grouped_cosine_ot): same values, gradients equal up to float rounding; False = the
# padded, concatenated ot_distance call with autograd through the cost (the old path).
GROUPED_COSINE_GRAD = True


def clip_loss(
    image_global: torch.Tensor,
    text_global: torch.Tensor,
    scale: torch.Tensor,
    negative_mask: torch.Tensor | None = None,
    row_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """Symmetric InfoNCE.

    Args:
        image_global: ``(batch, d)`` normalised image embeddings u_i.
        text_global: ``(batch, d)`` normalised caption embeddings w_pi(i) paired row by row.
        scale: scalar exp(t).
        negative_mask: optional ``bool (batch, batch)`` [ours]: logits ``(i, j)`` to leave out of both
            cross-entropies (as if that column were not there for row i, and that row not there for column j);
            the diagonal must be False.
        row_weight: optional ``(batch,)`` [ours]: pair i's row and column cross-entropies are multiplied by it
            (still averaged over ``batch``).
    """
    logits = scale * image_global @ text_global.T  # [batch, batch]
    target = torch.arange(len(logits), device=logits.device)
    if negative_mask is None and row_weight is None:
        return 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target))
    if negative_mask is not None:
        if negative_mask.diagonal().any():
            raise ValueError("clip_loss: negative_mask must not mask a positive (diagonal) pair")
        logits = logits.masked_fill(negative_mask, float("-inf"))
    rows = F.cross_entropy(logits, target, reduction="none")
    cols = F.cross_entropy(logits.T, target, reduction="none")
    if row_weight is not None:
        rows, cols = rows * row_weight, cols * row_weight
    return 0.5 * (rows.mean() + cols.mean())


def unimodal_loss(z1: torch.Tensor, z2: torch.Tensor, temperature: float) -> torch.Tensor:
    """InfoNCE between two views ``(batch, d)`` of the same items (normalised)."""
    return clip_loss(z1, z2, torch.tensor(1.0 / temperature, device=z1.device))


def ot_solve(
    x: torch.Tensor,
    y: torch.Tensor,
    x_mask: torch.Tensor | None,
    y_mask: torch.Tensor | None,
    cfg: OTConfig,
    matching: bool = False,
    cost: str | Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = "cosine",
) -> SinkhornResult:
    """Solve D(X_b, Y_b) for each pair and keep the diagnostics (``marginal_error``, ``converged``).

    Args:
        x: ``(B, n, d)``; y: ``(B, m, d)``; masks ``bool (B, n)``/``(B, m)`` or None.
        cfg: settings; with ``matching=True`` and ``cfg.match_tol`` set (Sinkhorn only), the solve runs up to
            ``cfg.match_max_iters`` iterations and each problem stops early once it meets the tolerance
            (:func:`reprlab.ot.sinkhorn`); ``converged`` is judged against ``match_tol``. With ``matching=False`` (the training
            losses) the same with ``cfg.loss_tol`` / ``cfg.loss_max_iters``. With the tolerance null,
            ``cfg.n_iters`` fixed iterations (``converged`` against
            :data:`reprlab.ot.result.DEFAULT_CONVERGED_TOL`). A missed tolerance does not warn here: the
            callers aggregate ``converged`` and warn once per epoch (or per audit).
        cost: ``"cosine"`` (1 - cos), or a callable ``(x, y) -> (B, n, m)`` that builds the same costs
            another way (re-matching builds them with one product per image, see ``otc_rematch``).
    """
    tol, n_iters = _stopping(cfg, matching)
    with _quiet(tol):
        return ot_distance(
            x,
            y,
            x_mask=x_mask,
            y_mask=y_mask,
            eps=cfg.eps,
            cost=cost,
            n_iters=n_iters,
            solver=cfg.solver,
            tol=tol,
        )


def _stopping(cfg: OTConfig, matching: bool) -> tuple[float | None, int]:
    """``(tol, n_iters)`` of a solve: the matching or loss tolerance and its iteration cap (Sinkhorn), else
    ``cfg.n_iters`` fixed iterations."""
    tol = (cfg.match_tol if matching else cfg.loss_tol) if cfg.solver == "sinkhorn" else None
    n_iters = (cfg.match_max_iters if matching else cfg.loss_max_iters) if tol is not None else cfg.n_iters
    return tol, n_iters


@contextlib.contextmanager
def _quiet(tol: float | None):
    """Silence the solver's missed-tolerance warning: callers aggregate ``converged`` and warn once per epoch
    (or per audit)."""
    with warnings.catch_warnings():
        if tol is not None:
            warnings.filterwarnings("ignore", message=r"OT \(", category=RuntimeWarning)
        yield


def ot_distances(
    x: torch.Tensor,
    y: torch.Tensor,
    x_mask: torch.Tensor | None,
    y_mask: torch.Tensor | None,
    cfg: OTConfig,
    matching: bool = False,
) -> torch.Tensor:
    """D(X_b, Y_b) for each pair: ``x (B, n, d)``, ``y (B, m, d)``, masks ``bool (B, n)``/``(B, m)`` -> ``(B,)``.

    See :func:`ot_solve` for ``matching``; the diagnostics are dropped here (use ``ot_solve`` to keep them).
    """
    return ot_solve(x, y, x_mask, y_mask, cfg, matching).cost


def ot_alignment(
    x: torch.Tensor,
    y: torch.Tensor,
    x_mask: torch.Tensor | None,
    y_mask: torch.Tensor | None,
    cfg: OTConfig,
    diagnostics: list[SinkhornResult] | None = None,
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean OT distance over paired sets (a scalar loss); gradients reach the features through the cost only.

    ``weight``: optional ``(B,)`` [ours] multiplying each pair's distance before the mean.

    Solved to ``cfg.loss_tol`` (or ``cfg.n_iters`` fixed iterations); the solver's result (marginal errors,
    iterations) is appended to ``diagnostics`` when a list is given.
    """
    res = ot_solve(x, y, x_mask, y_mask, cfg)
    if diagnostics is not None:
        diagnostics.append(res)
    return res.cost.mean() if weight is None else (res.cost * weight).mean()


def ot_alignments(
    pairs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]],
    cfg: OTConfig,
    diagnostics: list[SinkhornResult] | None = None,
    weights: list[torch.Tensor | None] | None = None,
) -> list[torch.Tensor]:
    """Several :func:`ot_alignment` losses from one solver call: ``[(x, y, x_mask, y_mask), ...]`` -> the
    mean distance of each group.

    [ours, speed] The OTCCLIP loss terms are three small batches (patches-tokens, patches-patches,
    tokens-tokens); the solver's cost per call is dominated by its ~100 sequential small ops, not by the
    problem count, so the groups are zero-padded (mask False) to a common ``(n, m)`` and solved together.
    Padding carries no mass, so each distance equals the separate solve up to float rounding (tested).
    ``weights``: optional list parallel to ``pairs`` of ``(B_group,)`` weights or None (see ``ot_alignment``).
    """
    if GROUPED_COSINE_GRAD and cfg.solver == "sinkhorn":  # [ours, speed] same solve, one backward node
        tol, n_iters = _stopping(cfg, matching=False)
        with _quiet(tol):
            parts, res = grouped_cosine_ot(pairs, cfg.eps, n_iters, tol)
    else:
        res = ot_solve(*pad_groups(pairs), cfg)
        parts = res.cost.split([len(x) for x, _, _, _ in pairs])
    if diagnostics is not None:
        diagnostics.append(res)
    weights = weights or [None] * len(parts)  # [ours] optional per-pair weights of a group, as ot_alignment
    return [part.mean() if w is None else (part * w).mean() for part, w in zip(parts, weights)]
