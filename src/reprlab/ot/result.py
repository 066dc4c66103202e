"""Output object shared by every OT solver in :mod:`reprlab.ot`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SinkhornResult:
    """Solution of a batch of entropic (or proximal) OT problems, with diagnostics.

    Shapes use the OT vocabulary of CONTRIBUTING.md: ``batch`` problems, ``n`` source points, ``m`` target
    points. When the solver was called with unbatched inputs (``C`` of shape ``(n, m)``) every field loses
    its leading ``batch`` dimension.

    Attributes:
        cost: ``(batch,)`` transport cost ``<P, C>`` (the "sharp" OT distance). With ``grad="envelope"``
            the plan is detached, so the gradient reaches ``C`` only through this inner product
            (dcost/dC = P).
        plan: ``(batch, n, m)`` transport plan ``P``; rows sum to ``a``, columns to ``b`` (up to
            ``marginal_error``). Zero on padded rows and columns.
        f: ``(batch, n)`` dual potential of the source, in cost units, such that
            ``P = a_k b_l exp((f_k + g_l - C_kl) / eps)``. Values at padded rows carry no weight and are 0.
        g: ``(batch, m)`` dual potential of the target (same convention; 0 at padded columns).
        marginal_error: ``(batch,)`` L1 violation of both marginals of the returned plan,
            ``|P 1 - a|_1 + |P^T 1 - b|_1`` with the renormalised weights.
        n_iters: number of iterations actually run (the whole batch runs the same number).
        converged: ``(batch,)`` bool tensor, ``marginal_error <= tol`` (``tol`` as passed, or
            :data:`DEFAULT_CONVERGED_TOL` when the solver ran without a tolerance). Always a tensor, never
            a Python bool, so code that indexes it does not depend on the call.
        reg_cost: ``(batch,)`` entropic objective ``<P, C> - eps * H(P)`` with
            ``H(P) = -sum P (log P - 1)``. Its exact derivative w.r.t. ``C`` is ``P`` (Danskin), so this is
            the field to finite-difference when checking the envelope gradient. For IPOT it uses the
            effective ``eps = beta / n_iters`` of the final plan.
        eps: the entropic regularisation in cost units (IPOT: the effective ``beta / n_iters``).
        solver: ``"sinkhorn-scaling"``, ``"sinkhorn-log"`` or ``"ipot"``: which code path produced this.
    """

    cost: Tensor
    plan: Tensor
    f: Tensor
    g: Tensor
    marginal_error: Tensor
    n_iters: int
    converged: Tensor
    reg_cost: Tensor
    eps: float
    solver: str

    def squeeze_batch(self) -> SinkhornResult:
        """Drop the leading batch dimension of size 1 (used for unbatched calls)."""
        return SinkhornResult(
            cost=self.cost[0],
            plan=self.plan[0],
            f=self.f[0],
            g=self.g[0],
            marginal_error=self.marginal_error[0],
            n_iters=self.n_iters,
            converged=self.converged[0],
            reg_cost=self.reg_cost[0],
            eps=self.eps,
            solver=self.solver,
        )


# [ours] When no tolerance is given, `converged` is judged against this L1 marginal error: at 1e-4 the
# plan's cost moves by at most 1e-4 * max|C|, far below the differences OTCCLIP re-matching acts on.
DEFAULT_CONVERGED_TOL = 1e-4


def converged_mask(marginal_error: Tensor, tol: float | None) -> Tensor:
    """``(batch,)`` bool: which problems meet ``tol`` (or :data:`DEFAULT_CONVERGED_TOL`)."""
    limit = DEFAULT_CONVERGED_TOL if tol is None else tol
    return torch.as_tensor(marginal_error <= limit)
