r"""IPOT: inexact proximal point OT (Xie et al. 2020), batched as in UNITER's word-region alignment.

Each outer iteration solves a KL-proximal step around the previous plan,

.. math::
    P^{t+1} = \arg\min_{P \in \Pi(a, b)} \langle P, C \rangle + \beta\, \mathrm{KL}(P \,\|\, P^{t}),

inexactly, with ``inner_iters`` Sinkhorn scaling steps on the kernel ``Q = exp(-C/beta) * P^t``:
``delta = a / (Q sigma)``, ``sigma = b / (Q^T delta)``, ``P^{t+1} = diag(delta) Q diag(sigma)``.
Unrolled, ``P^t`` is a Gibbs plan of effective regularisation ``beta / t``, so IPOT approaches the
unregularised OT plan as ``t`` grows. UNITER (``ChenRocks/UNITER``, ``model/ot.py``) uses ``beta = 0.5``,
50 outer and 1 inner iteration, no gradient through the solver, distance ``trace(C P^T)`` with ``P``
detached; those are this module's defaults.

[ours] ``C`` is shifted by its per-problem row minimum before ``exp(-C/beta)``: given the row marginal
constraint this adds a constant to every proximal objective, so the iterates are unchanged, but the kernel
cannot underflow a whole row for small ``beta``. If the scalings still over/underflow, we raise rather
than return NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor

from reprlab.ot.result import SinkhornResult
from reprlab.ot.sinkhorn import (
    _check_finite,
    _EnvelopeCost,
    _log_weights,
    _sanitize,
    _validate,
    finish_result,
)


def ipot(
    C: Tensor,
    a: Tensor,
    b: Tensor,
    beta: float = 0.5,
    n_iters: int = 50,
    inner_iters: int = 1,
) -> SinkhornResult:
    """Batched IPOT with padded weights; envelope gradient (plan detached) through ``cost = <P, C>``.

    Args:
        C: ``(batch, n, m)`` costs (or ``(n, m)``). Padded entries are ignored.
        a: ``(batch, n)`` non-negative source weights, 0 = padding, renormalised per problem.
        b: ``(batch, m)`` non-negative target weights, same conventions.
        beta: proximal step (KL weight), in cost units.
        n_iters: outer proximal iterations.
        inner_iters: Sinkhorn scaling steps per proximal iteration.

    Returns:
        :class:`SinkhornResult` with ``eps = beta / n_iters`` (the plan's effective regularisation),
        potentials ``f, g`` of the plan's Gibbs form at that ``eps``, ``solver="ipot"``, and
        ``converged`` judged on the marginal error against the default tolerance.

    Raises:
        ValueError: as :func:`reprlab.ot.sinkhorn` (shapes, weights, all-padding problems, non-finite costs).
        FloatingPointError: if the scalings over/underflow (``beta`` too small for the cost range).
    """
    if inner_iters < 1:
        raise ValueError(f"inner_iters must be >= 1; got {inner_iters}")
    if not (0 < beta < float("inf")):
        raise ValueError(f"beta must be a positive finite number; got {beta}")
    unbatched = C.dim() == 2
    if unbatched:
        C, a, b = C.unsqueeze(0), a.unsqueeze(0), b.unsqueeze(0)
    a, b = _validate(C, a, b, beta, n_iters, 1, "envelope")
    with torch.no_grad():
        Cs = _sanitize(C.detach(), a, b)
        _check_finite(Cs, 0)
        col_valid = (b > 0)[:, None, :]
        shift = torch.where(
            col_valid, Cs, torch.full((), float("inf"), dtype=Cs.dtype, device=Cs.device)
        ).amin(2)  # (batch, n)
        A = torch.exp((shift[:, :, None] - Cs) / beta)  # (batch, n, m), every valid row has a 1
        # UNITER's start: P^0 = 1 (all ones), sigma = b.
        plan = torch.ones_like(A)
        sum_log_delta = torch.zeros_like(a)
        sum_log_sigma = torch.zeros_like(b)
        sigma = b.clone()
        a_pad, b_pad = a == 0, b == 0
        for _ in range(n_iters):
            Q = A * plan
            for _ in range(inner_iters):
                # Padded rows/columns have zero mass and zero plan entries: 0/0 there is set to 0.
                delta = torch.where(a_pad, 0.0, a / torch.bmm(Q, sigma[:, :, None])[:, :, 0])
                sigma = torch.where(b_pad, 0.0, b / torch.bmm(delta[:, None, :], Q)[:, 0, :])
            plan = Q.mul_(delta[:, :, None]).mul_(sigma[:, None, :])
            # log(delta) = -inf at padded rows (a = 0): clamp so the potentials stay finite there.
            sum_log_delta += torch.log(delta).clamp_min(-1e5)
            sum_log_sigma += torch.log(sigma).clamp_min(-1e5)
        if not bool(torch.isfinite(plan).all()):
            bad = torch.nonzero(~torch.isfinite(plan).flatten(1).all(1)).flatten()[:5].tolist()
            raise FloatingPointError(
                f"IPOT scalings over/underflowed in batch problem(s) {bad}; increase beta (got {beta})"
            )
        # Unrolled, P^T = diag(prod delta) exp(T (shift - C)/beta) diag(prod sigma) with P^0 = 1, so with
        # eps_eff = beta / T the plan is a b exp((f + g - C)/eps_eff) for the potentials below.
        eps_eff = beta / n_iters
        f = eps_eff * (sum_log_delta - _log_weights(a)) + shift
        g = eps_eff * (sum_log_sigma - _log_weights(b))
        cost_value = torch.bmm(plan.reshape(len(plan), 1, -1), Cs.reshape(len(plan), -1, 1)).reshape(-1)
    cost = _EnvelopeCost.apply(C, cost_value, plan) if C.requires_grad else cost_value
    result = finish_result(cost, plan, f, g, a, b, eps_eff, n_iters, None, "ipot")
    return result.squeeze_batch() if unbatched else result
