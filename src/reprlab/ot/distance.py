"""OT distance between batches of ragged point sets: costs from points, uniform weights from masks.

This is the OTCCLIP patch-to-token distance ``D(V, T) = <P*, C>`` (``shared/papers/otcclip.md`` section
1.1 [ours]): cosine cost, uniform weights over the valid points, entropic OT, plan detached.
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
