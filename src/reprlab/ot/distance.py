"""OT distance between batches of ragged point sets: costs from points, uniform weights from masks.

This is the OTCCLIP patch-to-token distance ``D(V, T) = <P*, C>`` (the paper's
form; the details [ours], see ``docs/ot.md``): cosine cost, uniform weights over the valid points, entropic OT, plan detached.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from reprlab.ot.costs import cosine_cost, sq_euclidean_cost
from reprlab.ot.ipot import ipot
from reprlab.ot.result import SinkhornResult
from reprlab.ot.sinkhorn import sinkhorn

COSTS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "cosine": cosine_cost,
    "sqeuclidean": sq_euclidean_cost,
}
SOLVERS = ("sinkhorn", "ipot")


def _uniform_weights(mask: Tensor | None, batch: int, size: int, like: Tensor, name: str) -> Tensor:
    """``(batch, size)`` weights: 1 on valid points (mask True), 0 on padding; the solver renormalises."""
    if mask is None:
        return torch.ones(batch, size, dtype=like.dtype, device=like.device)
    if mask.dtype != torch.bool:
        raise ValueError(f"{name} must be a bool tensor (True = valid point); got {mask.dtype}")
    if tuple(mask.shape) != (batch, size):
        raise ValueError(f"{name} must have shape {(batch, size)}; got {tuple(mask.shape)}")
    return mask.to(like.dtype)


def ot_distance(
    X: Tensor,
    Y: Tensor,
    x_mask: Tensor | None = None,
    y_mask: Tensor | None = None,
    eps: float = 0.05,
    cost: str | Callable[[Tensor, Tensor], Tensor] = "cosine",
    n_iters: int = 50,
    solver: str = "sinkhorn",
    tol: float | None = None,
    *,
    grad: str = "envelope",
) -> SinkhornResult:
    """Entropic OT between ragged point sets, uniform weights over valid points.

    Args:
        X: ``(batch, n, d)`` source points (e.g. image patches), padded to a common ``n``.
        Y: ``(batch, m, d)`` target points (e.g. caption tokens), padded to a common ``m``.
        x_mask: ``(batch, n)`` bool, True = valid point; ``None`` = all valid.
        y_mask: ``(batch, m)`` bool, same.
        eps: Sinkhorn regularisation in cost units; for ``solver="ipot"`` it is the proximal step ``beta``
            (UNITER uses 0.5).
        cost: ``"cosine"`` (``1 - cos``, in ``[0, 2]``), ``"sqeuclidean"``, or a callable
            ``(X, Y) -> (batch, n, m)``.
        n_iters: solver iterations (all problems run the same number unless ``tol`` stops them early).
        solver: ``"sinkhorn"`` or ``"ipot"``.
        tol: marginal-error tolerance (Sinkhorn only): early stop plus a warning when not met.
        grad: Sinkhorn gradient mode, ``"envelope"`` (default) or ``"autograd"``; IPOT is always envelope.

    Returns:
        :class:`SinkhornResult`; ``result.cost`` ``(batch,)`` is the distance, differentiable w.r.t. ``X``
        and ``Y`` through the cost matrix.

    Raises:
        ValueError: unknown cost/solver, bad mask shape or dtype, a problem without valid points (names
            the batch index), or ``tol`` with IPOT.
    """
    if X.dim() != 3 or Y.dim() != 3:
        raise ValueError(
            f"X and Y must be (batch, n, d) and (batch, m, d); got {tuple(X.shape)}, {tuple(Y.shape)}"
        )
    if solver not in SOLVERS:
        raise ValueError(f"solver must be one of {SOLVERS}; got {solver!r}")
    if isinstance(cost, str):
        if cost not in COSTS:
            raise ValueError(f"cost must be one of {sorted(COSTS)} or a callable; got {cost!r}")
        cost_fn = COSTS[cost]
    else:
        cost_fn = cost
    batch, n, _ = X.shape
    a = _uniform_weights(x_mask, batch, n, X, "x_mask")
    b = _uniform_weights(y_mask, batch, Y.shape[1], X, "y_mask")
    C = cost_fn(X, Y)  # (batch, n, m)
    if solver == "ipot":
        if tol is not None:
            raise ValueError("tol is only supported by solver='sinkhorn' (IPOT runs a fixed n_iters)")
        return ipot(C, a, b, beta=eps, n_iters=n_iters)
    return sinkhorn(C, a, b, eps, n_iters=n_iters, tol=tol, grad=grad)


def pad_groups(
    groups: list[tuple[Tensor, Tensor, Tensor | None, Tensor | None]],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Groups ``(x (B_i, n_i, d), y (B_i, m_i, d), x_mask, y_mask)`` (masks ``None`` = all valid) zero-padded to
    the largest ``(n, m)`` (padding masked out) and concatenated: ``x (B, n, d), y (B, m, d), x_mask (B, n),
    y_mask (B, m)`` with ``B = sum B_i``. Padding carries no OT mass, so one solve equals the separate ones."""
    n = max(x.shape[1] for x, _, _, _ in groups)
    m = max(y.shape[1] for _, y, _, _ in groups)
    xs, ys, xms, yms = [], [], [], []
    for x, y, xm, ym in groups:
        xm = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device) if xm is None else xm
        ym = torch.ones(y.shape[:2], dtype=torch.bool, device=y.device) if ym is None else ym
        xs.append(torch.nn.functional.pad(x, (0, 0, 0, n - x.shape[1])))
        ys.append(torch.nn.functional.pad(y, (0, 0, 0, m - y.shape[1])))
        xms.append(torch.nn.functional.pad(xm, (0, n - xm.shape[1])))
        yms.append(torch.nn.functional.pad(ym, (0, m - ym.shape[1])))
    return torch.cat(xs), torch.cat(ys), torch.cat(xms), torch.cat(yms)


def grouped_cosine_ot(
    groups: list[tuple[Tensor, Tensor, Tensor | None, Tensor | None]],
    eps: float = 0.05,
    n_iters: int = 50,
    tol: float | None = None,
) -> tuple[list[Tensor], SinkhornResult]:
    """Sinkhorn OT distances of several groups of paired point sets in one solve, cosine cost, with one
    hand-written envelope backward for the whole group.

    Each group ``(x (B_i, n_i, d), y (B_i, m_i, d), x_mask, y_mask)`` (masks bool or ``None`` = all valid) is
    zero-padded (mask False) to the largest ``(n, m)`` and all groups are solved together, exactly as
    :func:`ot_distance` on the concatenated padded batch would (same costs, bitwise). [ours, speed] The
    gradient is the same envelope gradient (plan detached, ``dcost/dC = P``, zero where ``1 - cos`` was clamped
    into ``[0, 2]``), pushed through the cosine cost and both normalisations in one autograd node instead of
    about thirty (padding, concatenation, normalisation, product, clamp, envelope): equal up to float rounding
    (tested).

    Returns:
        ``([(B_i,) distances per group], the solver's result for the whole padded batch)``; the distances
        are differentiable w.r.t. every ``x`` and ``y``, the result's fields are not.
    """
    with torch.no_grad():
        X, Y, x_mask, y_mask = pad_groups(groups)
        batch, n, m = len(X), X.shape[1], Y.shape[1]
        a = _uniform_weights(x_mask, batch, n, X, "x_mask")
        b = _uniform_weights(y_mask, batch, m, X, "y_mask")
        # as F.normalize (x / max(|x|, 1e-12)) and cosine_cost, so the costs are bitwise those of ot_distance
        nx = X.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        ny = Y.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        Xn, Yn = X / nx.expand_as(X), Y / ny.expand_as(Y)
        raw = 1.0 - Xn @ Yn.transpose(-1, -2)
        C = raw.clamp(0.0, 2.0)
        res = sinkhorn(C, a, b, eps, n_iters=n_iters, tol=tol)
        inside = (raw >= 0.0) & (raw <= 2.0)  # where clamp passes the gradient
    layout = [(len(x), x.shape[1], y.shape[1]) for x, y, _, _ in groups]
    inputs = [t for x, y, _, _ in groups for t in (x, y)]
    costs = _GroupedCosineEnvelope.apply(res.cost, res.plan, inside, Xn, Yn, nx, ny, layout, *inputs)
    return list(costs), res


class _GroupedCosineEnvelope(torch.autograd.Function):
    """Per-group costs ``<P, C>`` of :func:`grouped_cosine_ot`; backward: ``dC = g P`` (inside the clamp range),
    through ``C = 1 - Xn Yn^T`` and ``Xn = X / |X|`` (``dX = (dXn - Xn <Xn, dXn>) / |X|``), cut back to each
    group's rows and points."""

    @staticmethod
    def forward(ctx, cost, plan, inside, Xn, Yn, nx, ny, layout, *inputs):  # noqa: D102
        ctx.save_for_backward(plan, inside, Xn, Yn, nx, ny)
        ctx.layout = layout
        ctx.needs = [t.requires_grad for t in inputs]
        return tuple(part.clone() for part in cost.split([rows for rows, _, _ in layout]))

    @staticmethod
    def backward(ctx, *grads):  # noqa: D102
        plan, inside, Xn, Yn, nx, ny = ctx.saved_tensors
        g = torch.cat(
            [
                torch.zeros(rows, dtype=plan.dtype, device=plan.device) if gr is None else gr
                for gr, (rows, _, _) in zip(grads, ctx.layout)
            ]
        )
        dC = (g[:, None, None] * plan).masked_fill_(~inside, 0.0)
        out: list[Tensor | None] = [None] * 8
        dXn, dYn = torch.bmm(dC, Yn).neg_(), torch.bmm(dC.transpose(1, 2), Xn).neg_()
        dX = (dXn - Xn * (Xn * dXn).sum(-1, keepdim=True)) / nx
        dY = (dYn - Yn * (Yn * dYn).sum(-1, keepdim=True)) / ny
        lo = 0
        for (rows, n, m), (need_x, need_y) in zip(ctx.layout, zip(ctx.needs[0::2], ctx.needs[1::2])):
            out.append(dX[lo : lo + rows, :n] if need_x else None)
            out.append(dY[lo : lo + rows, :m] if need_y else None)
            lo += rows
        return tuple(out)
