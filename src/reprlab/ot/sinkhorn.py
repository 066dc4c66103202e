r"""Batched entropic optimal transport (Sinkhorn), log-domain stable and fast on CPU.

For each problem in the batch we solve

.. math::
    \min_{P \ge 0,\ P 1 = a,\ P^T 1 = b} \langle P, C \rangle - \varepsilon H(P),
    \qquad H(P) = -\sum_{kl} P_{kl} (\log P_{kl} - 1)

with the Sinkhorn updates on the dual potentials (Cuturi 2013; log-domain form as in POT's
``sinkhorn_log``):

.. math::
    f_k \leftarrow -\varepsilon \log \sum_l b_l e^{(g_l - C_{kl})/\varepsilon}, \qquad
    g_l \leftarrow -\varepsilon \log \sum_k a_k e^{(f_k - C_{kl})/\varepsilon}, \qquad
    P_{kl} = a_k b_l e^{(f_k + g_l - C_{kl})/\varepsilon}.

One iteration is one ``f`` update followed by one ``g`` update, starting from ``g = 0`` (the order of
POT's ``ot.batch``; POT's single-problem ``ot.sinkhorn`` updates ``g`` first, which is the same algorithm
applied to ``C^T``).

Implementation [ours]. A log-domain update costs a ``logsumexp`` over the whole ``(batch, n, m)`` tensor,
i.e. an ``exp`` of every entry, twice per iteration. The fast path runs the *same iterates* in the scaling
domain with absorption (Schmitzer 2019, "Stabilized sparse scaling algorithms"): every ``check_every``
iterations the potentials are absorbed into a kernel ``K = exp((f + g - C)/eps)`` and the block runs the
multiplicative updates ``s = 1 / (K (b t))``, ``t = 1 / (K^T (a s))`` (two batched mat-vecs, no ``exp``);
at the block end ``f += eps log s``, ``g += eps log t``. The initial kernel is absorbed with ``f`` = the
row minimum of ``C`` (a reparametrisation: the iterates are unchanged), so every row holds an entry equal
to 1 and cannot underflow. If a block ever yields a non-finite or zero scaling (``eps`` tiny relative to
the cost range), that block is redone, and the rest finished, in the log domain, where ``log 0`` is clamped
to ``-1e5`` (geomloss's constant) so padding cannot produce ``-inf - (-inf) = NaN``. Both paths are the
same iteration and differ only by rounding. The batch is processed in cache-sized chunks.

On CPU in envelope mode the same scheme runs in the compiled kernel (:mod:`reprlab.ot.kernel`), one problem at
a time with its kernel resident in cache, padding skipped, absorption and log-domain blocks per problem; the
PyTorch code here is its fallback and the path on other devices and for ``grad="autograd"`` (docs/ot.md).
"""

from __future__ import annotations

import dataclasses
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torch import Tensor

from reprlab.ot import kernel
from reprlab.ot.result import SinkhornResult, converged_mask

# geomloss clamps log(0) to -1e5: exp() of it is exactly 0 in float32/64, and differences of two padded
# logs stay finite.
LOG_ZERO = -1e5

# [ours] Problems per chunk on the fast path: 256 problems of 49 x 32 float32 keep the kernel and its
# transpose (~3 MB) cache-resident across the iterations instead of streaming 25 MB per half-iteration at
# B = 4096 (see docs/ot.md for the measurement).
CHUNK = 256

# [ours, measured] On CPU, for problems of at most this many entries (n * m), the scaling updates run as a
# broadcast product and a sum over dim 1 instead of batched gemv (bmm): for OTCCLIP's 16 x 14 and 16 x 16
# problems this took 50 vs 84 us and 15 vs 32 us per iteration (256 and 82 problems, 1 thread); MKL's
# per-matrix overhead dominates bmm on such tiny matrices. Same iteration, different rounding (~1e-6).
SMALL_PROBLEM = 512

# [ours, measured] On CPU, small problems (n * m <= SMALL_PROBLEM, float32/64) run the block's scaling updates
# as NumPy batched mat-vecs (``np.matmul`` on (batch, n, m) x (batch, m, 1)) on kernels with the weights folded
# in (``K diag(b)`` and ``(diag(a) K)^T``): one call per half-iteration instead of four torch ops. For
# OTCCLIP's loss problems (76 x 16 x 17) this took 11 vs 33 us per iteration, for its re-matching problems
# (250 x 16 x 14) 30 vs 78 us (1 thread). Same iteration, different rounding (~1e-7 relative in float32).
# The convergence check reads the row marginal from one more mat-vec instead of forming the plan.
# False = the torch broadcast-product path above (the old path).
NUMPY_SMALL = True

# [ours, measured] With a tolerance, a problem that meets it at a check is retired: its plan and potentials
# are final, and the chunk's remaining blocks run on the still-active problems only (the arrays are compacted,
# so the batch stays one batched op; a per-problem loop would serialise it).
# Each problem then stops at its first check below ``tol`` instead of when the whole chunk does. On OTCCLIP's
# re-matching problems one slow problem kept 250 problems iterating 340 times where the others needed 40
# (docs/ot.md). False = the whole chunk runs until its largest error meets ``tol`` (the old rule).
RETIRE_CONVERGED = True

# [ours, measured] CPU, envelope mode: solve with the compiled kernel (reprlab.ot.kernel: each problem's kernel
# and scalings stay in cache for all its iterations, padding skipped, per-problem stopping and log-domain
# fallback); the PyTorch paths below are the fallback when it cannot be built, and run on other devices and
# for grad="autograd". B = 4096 x 49 x <=32 at 50 iterations: see docs/ot.md. False = the PyTorch paths.
COMPILED = True

# [ours] Below this many entry-iterations (batch * n * m * n_iters) the kernel runs on the calling thread:
# ~1e6 take ~1 ms, comparable to handing chunks to worker threads.
KERNEL_PARALLEL_WORK = 2_000_000

# [ours, measured] bfloat16 / float16 costs are solved in float32 and every result field is rounded back to the
# input's dtype: iterating in half precision leaves marginal errors of ~1e-2 (docs/ot.md, bench_ot.py --dtypes).
# False = iterate in the input's dtype (the old behaviour).
HALF_IN_FLOAT32 = True

_GRAD_MODES = ("envelope", "autograd")


def sinkhorn(
    C: Tensor,
    a: Tensor,
    b: Tensor,
    eps: float,
    n_iters: int = 50,
    tol: float | None = None,
    check_every: int = 10,
    grad: str = "envelope",
) -> SinkhornResult:
    """Solve a batch of entropic OT problems with (padded) weights.

    Args:
        C: ``(batch, n, m)`` cost matrices (or ``(n, m)`` for a single problem). Entries at padded rows or
            columns are ignored (they may even be NaN) and receive zero gradient.
        a: ``(batch, n)`` non-negative source weights; 0 marks padding. Renormalised to sum to 1 over each
            problem's valid entries.
        b: ``(batch, m)`` non-negative target weights, same conventions.
        eps: entropic regularisation, in cost units (cosine cost lives in ``[0, 2]``).
        n_iters: maximum number of iterations (``f`` then ``g`` update); without ``tol`` every problem runs
            this many.
        tol: optional tolerance on the L1 marginal error, checked every ``check_every`` iterations. When
            given, in the compiled kernel and on the PyTorch scaling path each problem stops at its first check
            below it (:data:`RETIRE_CONVERGED`: the others go on as one compacted batch; ``n_iters`` of the result
            is the largest count); with ``grad="autograd"`` or after a PyTorch-path log-domain fallback the batch
            stops when its largest error is below it. A ``RuntimeWarning`` is emitted if any problem is still above ``tol`` at
            the end.
        check_every: iterations between convergence checks (and, on the fast path, kernel absorptions).
        grad: ``"envelope"`` (default): iterations run without autograd, the plan is detached and the
            gradient reaches ``C`` only through ``cost = <P, C>`` (dcost/dC = P). ``"autograd"``:
            differentiate through every log-domain iteration (slow; memory grows with ``n_iters``).

    Returns:
        :class:`SinkhornResult`; unbatched inputs give unbatched fields.

    Raises:
        ValueError: on bad shapes, negative or non-finite weights, a problem whose weights are all zero
            (the message names the batch index), non-finite costs at valid entries, ``eps <= 0``.
    """
    if HALF_IN_FLOAT32 and C.dtype in (torch.bfloat16, torch.float16):
        # solved in float32 (differentiably cast), every field rounded back to the input's dtype
        res = sinkhorn(C.float(), a.float(), b.float(), eps, n_iters, tol, check_every, grad)
        return dataclasses.replace(
            res,
            **{
                k: getattr(res, k).to(C.dtype)
                for k in ("cost", "plan", "f", "g", "marginal_error", "reg_cost")
            },
        )
    unbatched = C.dim() == 2
    if unbatched:
        C, a, b = C.unsqueeze(0), a.unsqueeze(0), b.unsqueeze(0)
    lib = _compiled_kernel(C) if grad == "envelope" else None
    if lib is not None:
        _check_args(C, a, b, eps, n_iters, check_every, grad)
        result = _kernel_sinkhorn(lib, C, a, b, eps, n_iters, tol, check_every)
        return result.squeeze_batch() if unbatched else result
    a, b = _validate(C, a, b, eps, n_iters, check_every, grad)

    if grad == "autograd":
        Cs = _sanitize(C, a, b)  # out of place: keeps the graph
        _check_finite(Cs.detach(), 0)
        f, g, done = _log_iterations(Cs, a, b, eps, None, None, n_iters, tol, check_every)
        plan = gibbs_plan(Cs, a, b, f, g, eps)
        cost = (plan * Cs).sum((1, 2))
        solver, marginals = "sinkhorn-log", None
    else:
        with torch.no_grad():
            f, g, plan, cost_value, marginals, done, solver = _chunked_fast_sinkhorn(
                C.detach(), a, b, eps, n_iters, tol, check_every
            )
        cost = _EnvelopeCost.apply(C, cost_value, plan) if C.requires_grad else cost_value
    result = finish_result(cost, plan, f, g, a, b, eps, done, tol, solver, marginals)
    return result.squeeze_batch() if unbatched else result


class _EnvelopeCost(torch.autograd.Function):
    """``cost = <P, C>`` with ``P`` held fixed: backward gives ``dC = grad_cost * P`` (envelope theorem).

    The value was already computed chunk by chunk; this only attaches the gradient, so the envelope mode
    needs no extra pass over ``C`` and padded (possibly NaN) costs never enter the graph.
    """

    @staticmethod
    def forward(ctx, C: Tensor, cost_value: Tensor, plan: Tensor) -> Tensor:  # noqa: D102
        ctx.save_for_backward(plan)
        return cost_value.clone()

    @staticmethod
    def backward(ctx, grad_cost: Tensor) -> tuple[Tensor, None, None]:  # noqa: D102
        (plan,) = ctx.saved_tensors
        return grad_cost[:, None, None] * plan, None, None


def _compiled_kernel(C: Tensor):
    """The compiled kernel if it applies to ``C`` (CPU, a floating dtype, :data:`COMPILED` and
    :data:`RETIRE_CONVERGED` on: it always stops per problem) and could be built, else ``None``."""
    if not (COMPILED and RETIRE_CONVERGED) or C.device.type != "cpu" or C.dtype not in _KERNEL_DTYPES:
        return None
    return kernel.load()


_KERNEL_DTYPES = (torch.float32, torch.float64)


def _kernel_sinkhorn(
    lib, C: Tensor, a: Tensor, b: Tensor, eps: float, n_iters: int, tol: float | None, check_every: int
) -> SinkhornResult:
    """Envelope-mode solve with the compiled kernel (:func:`reprlab.ot.kernel.solve`: the weights are checked and
    renormalised, and the marginal error and entropy term computed, per problem inside it), float32 or float64.
    Raises as :func:`_validate` and :func:`_check_finite` do, with the same messages."""
    with torch.no_grad():
        out = kernel.solve(
            lib,
            C.detach(),
            a.detach().to(C.dtype),
            b.detach().to(C.dtype),
            eps,
            n_iters,
            tol,
            check_every,
            KERNEL_PARALLEL_WORK,
        )
    flags = out.flags
    if bool(flags.any()):
        for bit, name, what in (
            (kernel.BAD_A, "a", "bad"), (kernel.BAD_B, "b", "bad"), (kernel.EMPTY_A, "a", "empty"),
            (kernel.EMPTY_B, "b", "empty"), (kernel.NONFINITE_COST, "C", "cost"),
        ):  # fmt: skip
            hit = (flags & bit) != 0
            if bool(hit.any()):
                idx = torch.nonzero(hit).flatten()[:5].tolist()
                if what == "bad":
                    raise ValueError(f"weights {name} must be finite and >= 0; bad in batch problem(s) {idx}")
                if what == "empty":
                    raise ValueError(
                        f"all-padding OT problem: weights {name} are all zero in batch problem(s) {idx}; "
                        "every problem needs at least one valid point on each side"
                    )
                raise ValueError(f"non-finite cost at valid (non-padded) entries of batch problem(s) {idx}")
    solver = "sinkhorn-log" if bool((flags & kernel.USED_LOG).any()) else "sinkhorn-scaling"
    done = int(out.iters.max())
    cost_value = out.cost.to(C.dtype)
    cost = _EnvelopeCost.apply(C, cost_value, out.plan) if C.requires_grad else cost_value
    if not bool(torch.isfinite(cost_value).all()):
        bad = torch.nonzero(~torch.isfinite(cost_value)).flatten()[:5].tolist()
        raise FloatingPointError(f"OT produced a non-finite cost in batch problem(s) {bad} (solver {solver})")
    err = out.err.to(C.dtype)
    converged = converged_mask(err, tol)
    if tol is not None and not bool(converged.all()):
        _warn_unconverged(solver, tol, done, err, converged)
    return SinkhornResult(
        cost=cost,
        plan=out.plan,
        f=out.f,
        g=out.g,
        marginal_error=err,
        n_iters=done,
        converged=converged,
        reg_cost=cost + out.ent.to(C.dtype),  # the entropy term is a detached constant (see finish_result)
        eps=eps,
        solver=solver,
    )


def _validate(
    C: Tensor, a: Tensor, b: Tensor, eps: float, n_iters: int, check_every: int, grad: str
) -> tuple[Tensor, Tensor]:
    """Check shapes and options; return the renormalised weights ``(a, b)`` in ``C``'s dtype."""
    _check_args(C, a, b, eps, n_iters, check_every, grad)
    return normalise_weights(a.detach().to(C.dtype), "a"), normalise_weights(b.detach().to(C.dtype), "b")


def _check_args(
    C: Tensor, a: Tensor, b: Tensor, eps: float, n_iters: int, check_every: int, grad: str
) -> None:
    """Shapes, dtype and options (no pass over the data)."""
    if C.dim() != 3:
        raise ValueError(f"C must be (batch, n, m) or (n, m); got shape {tuple(C.shape)}")
    batch, n, m = C.shape
    if tuple(a.shape) != (batch, n) or tuple(b.shape) != (batch, m):
        raise ValueError(
            f"weights must be a: (batch, n) = {(batch, n)} and b: (batch, m) = {(batch, m)} to match C "
            f"{tuple(C.shape)}; got a {tuple(a.shape)}, b {tuple(b.shape)}"
        )
    if batch == 0 or n == 0 or m == 0:
        raise ValueError(f"empty OT problem: C has shape {tuple(C.shape)}")
    if not C.is_floating_point():
        raise ValueError(f"C must be a floating tensor; got {C.dtype}")
    if not (0 < eps < float("inf")):
        raise ValueError(f"eps must be a positive finite number; got {eps}")
    if n_iters < 1 or check_every < 1:
        raise ValueError(f"n_iters and check_every must be >= 1; got {n_iters} and {check_every}")
    if grad not in _GRAD_MODES:
        raise ValueError(f"grad must be one of {_GRAD_MODES}; got {grad!r}")


def normalise_weights(w: Tensor, name: str) -> Tensor:
    """Renormalise ``(batch, n)`` weights to sum to 1 per problem; raise on negative or all-zero rows."""
    bad_rows = ~torch.isfinite(w).all(1) | (w < 0).any(1)
    if bool(bad_rows.any()):
        bad = torch.nonzero(bad_rows).flatten()[:5].tolist()
        raise ValueError(f"weights {name} must be finite and >= 0; bad in batch problem(s) {bad}")
    mass = w.sum(1)
    empty = mass <= 0
    if bool(empty.any()):
        bad = torch.nonzero(empty).flatten()[:5].tolist()
        raise ValueError(
            f"all-padding OT problem: weights {name} are all zero in batch problem(s) {bad}; "
            "every problem needs at least one valid point on each side"
        )
    return w / mass[:, None]


def _sanitize(C: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """Set costs at padded entries to 0 (out of place), so they never feed NaN/inf into the solver."""
    row_pad, col_pad = a == 0, b == 0
    if not (bool(row_pad.any()) or bool(col_pad.any())):
        return C
    valid = ~row_pad[:, :, None] & ~col_pad[:, None, :]  # (batch, n, m)
    return torch.where(valid, C, torch.zeros((), dtype=C.dtype, device=C.device))


def _check_finite(C: Tensor, offset: int) -> None:
    """Raise naming the batch indices (``offset`` = index of ``C[0]``) whose valid costs are not finite."""
    if C.dtype == torch.float64:
        finite = torch.isfinite(C).flatten(1).all(1)
    else:
        # A float64 sum of float32/16 entries is finite iff every entry is (NaN/inf propagate and no finite
        # sum can overflow float64); one reduction is several times cheaper than isfinite + all.
        finite = torch.isfinite(C.sum((1, 2), dtype=torch.float64))
    if not bool(finite.all()):
        bad = (torch.nonzero(~finite).flatten()[:5] + offset).tolist()
        raise ValueError(f"non-finite cost at valid (non-padded) entries of batch problem(s) {bad}")


def _log_weights(w: Tensor) -> Tensor:
    """``log w`` with ``log 0`` clamped to :data:`LOG_ZERO` (see module docstring)."""
    return torch.log(w).clamp_min(LOG_ZERO)


def _log_iterations(
    C: Tensor,
    a: Tensor,
    b: Tensor,
    eps: float,
    f: Tensor | None,
    g: Tensor | None,
    n_iters: int,
    tol: float | None,
    check_every: int,
    done_before: int = 0,
) -> tuple[Tensor, Tensor, int]:
    """Plain log-domain Sinkhorn (out of place, so it is differentiable when ``C`` requires grad).

    Args:
        C: ``(batch, n, m)`` costs (padding already zeroed).
        a, b: ``(batch, n)``, ``(batch, m)`` normalised weights.
        f, g: starting potentials, or ``None`` for zeros.
        n_iters: iterations to run at most; ``done_before`` offsets the convergence-check schedule.

    Returns:
        ``(f, g, total iterations done including done_before)``.
    """
    log_a, log_b = _log_weights(a), _log_weights(b)
    neg_c = C / -eps  # (batch, n, m), computed once
    if g is None:
        g = torch.zeros_like(b)
    done = done_before
    for _ in range(n_iters):
        f = -eps * torch.logsumexp(neg_c + (log_b + g / eps)[:, None, :], dim=2)
        g = -eps * torch.logsumexp(neg_c + (log_a + f / eps)[:, :, None], dim=1)
        done += 1
        if tol is not None and done % check_every == 0:
            with torch.no_grad():
                err = marginal_error(gibbs_plan(C.detach(), a, b, f.detach(), g.detach(), eps), a, b)
            if float(err.max()) <= tol:
                break
    assert f is not None
    return f, g, done


def _chunked_fast_sinkhorn(
    C: Tensor, a: Tensor, b: Tensor, eps: float, n_iters: int, tol: float | None, check_every: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, tuple[Tensor, Tensor], int, str]:
    """Solve chunks of :data:`CHUNK` problems with :func:`_fast_sinkhorn`, one chunk per worker thread.

    Chunks are independent problems, so chunking changes only memory locality (and, with ``tol``, lets a
    converged chunk stop early). [ours] The solver issues thousands of small ops; letting each op fan out
    over torch's intra-op pool costs a thread barrier per op, which on a loaded machine (a descheduled
    worker) turned 1.4 s into 20-40 s at B = 4096 on 2 cores. So intra-op threads are set to 1 for the
    duration of the call (process-global; restored afterwards) and chunks run in a thread pool of the
    previous size instead (torch ops release the GIL).

    Returns:
        ``(f, g, plan, cost, (row sums, column sums) of the plan, iterations, solver)``: iterations is the
        largest over chunks and solver is ``"sinkhorn-log"`` if any chunk fell back to the log domain.
    """
    batch = C.shape[0]
    plan = torch.empty_like(C)
    # On an accelerator, chunking would only multiply kernel launches: one chunk, no thread pool.
    chunk = CHUNK if C.device.type == "cpu" else batch
    bounds = [(lo, min(lo + chunk, batch)) for lo in range(0, batch, chunk)]

    def solve(lo: int, hi: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, int, str]:
        with torch.no_grad():  # grad mode is thread-local: worker threads need their own
            Cc, ac, bc = _sanitize(C[lo:hi], a[lo:hi], b[lo:hi]), a[lo:hi], b[lo:hi]
            _check_finite(Cc, lo)
            f, g, plan_c, done, solver = _fast_sinkhorn(
                Cc, ac, bc, eps, n_iters, tol, check_every, plan[lo:hi]
            )
            if plan_c.data_ptr() != plan[lo:hi].data_ptr():  # the log-domain fallback allocates its own
                plan[lo:hi] = plan_c
            # Per-problem <P, C> and the marginals while the chunk is still in cache.
            cost = torch.bmm(plan_c.reshape(hi - lo, 1, -1), Cc.reshape(hi - lo, -1, 1)).reshape(-1)
            return f, g, cost, plan_c.sum(2), plan_c.sum(1), done, solver

    if len(bounds) == 1 and C.device.type != "cpu":
        outs = [solve(0, batch)]
        f, g, cost, rows, cols = outs[0][:5]
        return f, g, plan, cost, (rows, cols), outs[0][5], outs[0][6]
    threads = torch.get_num_threads()
    workers = min(threads, len(bounds))
    torch.set_num_threads(1)
    try:
        if workers > 1:
            with ThreadPoolExecutor(workers) as pool:
                outs = list(pool.map(lambda lh: solve(*lh), bounds))
        else:
            outs = [solve(lo, hi) for lo, hi in bounds]
    finally:
        torch.set_num_threads(threads)
    f, g, cost, rows, cols = (torch.cat([o[i] for o in outs]) for i in range(5))
    solver = "sinkhorn-log" if any(o[6] == "sinkhorn-log" for o in outs) else "sinkhorn-scaling"
    return f, g, plan, cost, (rows, cols), max(o[5] for o in outs), solver


def _fast_sinkhorn(
    C: Tensor,
    a: Tensor,
    b: Tensor,
    eps: float,
    n_iters: int,
    tol: float | None,
    check_every: int,
    out: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, int, str]:
    """Scaling-domain Sinkhorn with absorption every ``check_every`` iterations (no autograd).

    Args:
        C: ``(batch, n, m)`` sanitised costs; a, b: normalised weights.
        out: optional contiguous ``(batch, n, m)`` buffer used as the kernel and returned as the plan
            (saves a copy when the caller owns the output).

    Returns:
        ``(f, g, plan, iterations done, solver name)``; see the module docstring for the scheme.
    """
    batch, n, m = C.shape
    neg_c = C / -eps  # (batch, n, m)
    # Start: g = 0 and f absorbed as the row minimum of C over valid columns, so every valid row of the
    # first kernel has an entry exactly 1. This only reparametrises f (the first update overwrites it).
    col_valid = (b > 0)[:, None, :]
    f = torch.where(col_valid, C, torch.full((), float("inf"), dtype=C.dtype, device=C.device)).amin(2)
    g = torch.zeros_like(b)
    K = torch.empty_like(C) if out is None else out  # kernel, reused across absorptions; becomes the plan
    KT = torch.empty(batch, m, n, dtype=C.dtype, device=C.device)  # contiguous transpose for K (b t)
    row = torch.empty(batch, 1, n, dtype=C.dtype, device=C.device)
    col = torch.empty(batch, 1, m, dtype=C.dtype, device=C.device)
    a3, b3 = a[:, None, :], b[:, None, :]  # (batch, 1, n), (batch, 1, m)
    small = C.device.type == "cpu" and n * m <= SMALL_PROBLEM
    use_np = small and NUMPY_SMALL and C.dtype in (torch.float32, torch.float64)
    if use_np:
        return _numpy_blocks(C, neg_c, a, b, eps, f, g, K, KT, n_iters, tol, check_every)
    if small:  # scratch for the broadcast products of the small-problem path
        buf, bufT = torch.empty_like(K), torch.empty_like(KT)
    done = 0
    s = t = row
    act = None  # chunk indices of the still-active problems once some were retired (None: all active)
    f_out, g_out = f.clone(), g.clone()  # final potentials, filled as problems retire
    Kw, KTw, aw, bw, negw = K, KT, a, b, neg_c  # the active problems' arrays
    while done < n_iters:
        block = min(check_every, n_iters - done)
        # Absorb: K = exp(-C/eps + f/eps + g/eps), in place (the only exp pass of the block).
        torch.add(negw, (f / eps)[:, :, None], out=Kw)
        Kw.add_((g / eps)[:, None, :]).exp_()
        KTw.copy_(Kw.transpose(1, 2))
        t = torch.ones(len(Kw), 1, m, dtype=C.dtype, device=C.device)
        for _ in range(block):
            if small:
                # Broadcast product + sum over dim 1 (the contiguous inner dim vectorises), into buffers.
                torch.sum(torch.mul(KTw, (b3 * t).transpose(1, 2), out=bufT), 1, keepdim=True, out=row)
                s = row.reciprocal_()
                torch.sum(torch.mul(Kw, (a3 * s).transpose(1, 2), out=buf), 1, keepdim=True, out=col)
            else:
                # Row-vector x matrix products (batched gemv); on CPU this orientation is faster than
                # (n, m) x (m, 1), hence the transposed copy for the f update.
                torch.bmm(b3 * t, KTw, out=row)
                s = row.reciprocal_()
                torch.bmm(a3 * s, Kw, out=col)
            t = col.reciprocal()
        f_new = f + eps * torch.log(s[:, 0])
        g_new = g + eps * torch.log(t[:, 0])
        if not (bool(torch.isfinite(f_new).all()) and bool(torch.isfinite(g_new).all())):
            # Scalings over/underflowed: redo this block and finish in the log domain from the last good
            # potentials (the first f is a placeholder, overwritten by the first log update); retired
            # problems rejoin there (their potentials are final, so their updates barely move them).
            if act is not None:
                f_out[act], g_out[act] = f, g
                f, g = f_out, g_out
            f, g, done = _log_iterations(C, a, b, eps, f, g, n_iters - done, tol, check_every, done)
            return f, g, gibbs_plan(C, a, b, f, g, eps), done, "sinkhorn-log"
        f, g = f_new, g_new
        done += block
        if tol is not None and done < n_iters:
            plan = _scaled_plan(Kw.clone(), aw, bw, s, t)
            conv = marginal_error(plan, aw, bw) <= tol
            if bool(conv.all()):
                break
            if RETIRE_CONVERGED and bool(conv.any()):
                idx = torch.nonzero(conv).flatten()
                rows_out = idx if act is None else act[idx]
                keep = torch.nonzero(~conv).flatten()
                K[rows_out], f_out[rows_out], g_out[rows_out] = plan[idx], f[idx], g[idx]
                act = keep if act is None else act[keep]
                aw, bw, negw, f, g = aw[keep], bw[keep], negw[keep], f[keep], g[keep]
                a3, b3 = aw[:, None, :], bw[:, None, :]
                Kw, KTw = torch.empty_like(negw), torch.empty(len(keep), m, n, dtype=C.dtype, device=C.device)
                row = torch.empty(len(keep), 1, n, dtype=C.dtype, device=C.device)
                col = torch.empty(len(keep), 1, m, dtype=C.dtype, device=C.device)
                if small:
                    buf, bufT = torch.empty_like(Kw), torch.empty_like(KTw)
    # The last block's kernel and scalings give the plan without another exp pass.
    plan = _scaled_plan(Kw, aw, bw, s, t)
    if act is None:
        return f, g, plan, done, "sinkhorn-scaling"
    K[act], f_out[act], g_out[act] = plan, f, g
    return f_out, g_out, K, done, "sinkhorn-scaling"


def _numpy_blocks(
    C: Tensor,
    neg_c: Tensor,
    a: Tensor,
    b: Tensor,
    eps: float,
    f: Tensor,
    g: Tensor,
    K: Tensor,
    KT: Tensor,
    n_iters: int,
    tol: float | None,
    check_every: int,
) -> tuple[Tensor, Tensor, Tensor, int, str]:
    """:func:`_fast_sinkhorn`'s blocks run on NumPy views of the same buffers (see :data:`NUMPY_SMALL`): the
    scaling updates as batched mat-vecs against kernels with the weights folded in, the absorptions and
    checks as NumPy ufuncs (about 1 us per call instead of several for a torch op on these tiny arrays). Same
    absorption schedule, convergence test, fallback and outputs. ``K`` becomes the plan; ``KT`` is scratch
    for ``(diag(a) K)^T``."""
    batch, n, m = C.shape
    Kn, KaT, negc = K.numpy(), KT.numpy(), neg_c.numpy()
    an, bn = a.numpy(), b.numpy()
    fn, gn = f.numpy(), g.numpy()
    f_out, g_out = fn.copy(), gn.copy()  # final potentials, filled as problems retire (RETIRE_CONVERGED)
    act = None  # chunk indices of the still-active problems once some were retired (None: all active)
    Kw = Kn  # the active problems' kernel (a fresh, smaller array after a retirement)
    Kb = np.empty_like(Kn)  # K diag(b): Kb @ t = K (b t); KaT = (diag(a) K)^T: KaT @ s = K^T (a s)
    s, c, t = (np.empty((batch, size, 1), Kn.dtype) for size in (n, m, m))
    done = 0
    with np.errstate(all="ignore"):  # over/underflow shows up as a non-finite potential below
        while done < n_iters:
            block = min(check_every, n_iters - done)
            # Absorb: K = exp(-C/eps + f/eps + g/eps), in place (the only exp pass of the block).
            np.add(negc, (fn / eps)[:, :, None], out=Kw)
            Kw += (gn / eps)[:, None, :]
            np.exp(Kw, out=Kw)
            np.multiply(Kw, bn[:, None, :], out=Kb)
            np.multiply(Kw.transpose(0, 2, 1), an[:, None, :], out=KaT)
            t.fill(1.0)
            for _ in range(block):
                np.matmul(Kb, t, out=s)
                np.reciprocal(s, out=s)
                np.matmul(KaT, s, out=c)
                np.reciprocal(c, out=t)
            f_new = fn + eps * np.log(s[:, :, 0])
            g_new = gn + eps * np.log(t[:, :, 0])
            if not (np.isfinite(f_new).all() and np.isfinite(g_new).all()):
                # as in _fast_sinkhorn: redo this block and finish in the log domain from the last good
                # potentials (retired problems rejoin with their final ones)
                if act is not None:
                    f_out[act], g_out[act] = fn, gn
                    fn, gn = f_out, g_out
                f, g = torch.from_numpy(fn), torch.from_numpy(gn)
                f, g, done = _log_iterations(C, a, b, eps, f, g, n_iters - done, tol, check_every, done)
                return f, g, gibbs_plan(C, a, b, f, g, eps), done, "sinkhorn-log"
            fn, gn = f_new, g_new
            done += block
            if tol is not None and done < n_iters:
                # Marginals of P = diag(a s) K diag(b t) without forming it: rows a s (K (b t)), one more
                # mat-vec; columns b t (K^T (a s)), from the last half-iteration.
                rows = np.matmul(Kb, t)[:, :, 0]
                err = np.abs(an * s[:, :, 0] * rows - an).sum(1) + np.abs(
                    bn * t[:, :, 0] * c[:, :, 0] - bn
                ).sum(1)
                conv = err <= tol
                if conv.all():
                    break
                if RETIRE_CONVERGED and conv.any():
                    out = np.nonzero(conv)[0] if act is None else act[conv]
                    Kn[out] = (
                        Kw[conv] * (an * s[:, :, 0])[conv][:, :, None] * (bn * t[:, :, 0])[conv][:, None, :]
                    )
                    f_out[out], g_out[out] = fn[conv], gn[conv]
                    keep = ~conv
                    act = np.nonzero(keep)[0] if act is None else act[keep]
                    negc, an, bn, fn, gn = negc[keep], an[keep], bn[keep], fn[keep], gn[keep]
                    k = len(act)
                    Kw, Kb, KaT = (
                        np.empty((k, n, m), Kn.dtype),
                        np.empty((k, n, m), Kn.dtype),
                        np.empty((k, m, n), Kn.dtype),
                    )
                    s, c, t = (np.empty((k, size, 1), Kn.dtype) for size in (n, m, m))
        # The last block's kernel and scalings give the plan without another exp pass (in place on K).
        Kw *= (an * s[:, :, 0])[:, :, None]
        Kw *= (bn * t[:, :, 0])[:, None, :]
    if act is None:
        return torch.from_numpy(fn), torch.from_numpy(gn), K, done, "sinkhorn-scaling"
    Kn[act] = Kw
    f_out[act], g_out[act] = fn, gn
    return torch.from_numpy(f_out), torch.from_numpy(g_out), K, done, "sinkhorn-scaling"


def _scaled_plan(K: Tensor, a: Tensor, b: Tensor, s: Tensor, t: Tensor) -> Tensor:
    """``P = diag(a s) K diag(b t)``, in place on ``K``. ``s``: (batch, 1, n), ``t``: (batch, 1, m)."""
    return K.mul_((a[:, None, :] * s).transpose(1, 2)).mul_(b[:, None, :] * t)


def gibbs_plan(C: Tensor, a: Tensor, b: Tensor, f: Tensor, g: Tensor, eps: float) -> Tensor:
    """``P_kl = a_k b_l exp((f_k + g_l - C_kl)/eps)`` computed in the log domain; ``(batch, n, m)``."""
    log_a, log_b = _log_weights(a), _log_weights(b)
    return torch.exp((f / eps + log_a)[:, :, None] + (g / eps + log_b)[:, None, :] - C / eps)


def marginal_error(plan: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """``(batch,)`` L1 violation ``|P 1 - a|_1 + |P^T 1 - b|_1``."""
    return (plan.sum(2) - a).abs().sum(1) + (plan.sum(1) - b).abs().sum(1)


def _warn_unconverged(solver: str, tol: float, done: int, err: Tensor, converged: Tensor) -> None:
    warnings.warn(
        f"OT ({solver}) did not reach tol={tol:g} after {done} iterations: largest marginal error "
        f"{float(err.max()):.3g} in {int((~converged).sum())} of {len(err)} problems. "
        "Increase n_iters or eps.",
        RuntimeWarning,
        stacklevel=4,
    )


def finish_result(
    cost: Tensor,
    plan: Tensor,
    f: Tensor,
    g: Tensor,
    a: Tensor,
    b: Tensor,
    eps: float,
    done: int,
    tol: float | None,
    solver: str,
    marginals: tuple[Tensor, Tensor] | None = None,
) -> SinkhornResult:
    """Assemble a :class:`SinkhornResult` from a solved batch: diagnostics, entropic objective, warning.

    Args:
        cost: ``(batch,)`` ``<P, C>``, carrying whatever gradient path the solver attached.
        plan: ``(batch, n, m)``; f, g: potentials; a, b: normalised weights.
        marginals: precomputed ``(P 1, P^T 1)`` (saves two passes over the plan), or None.

    Raises:
        FloatingPointError: if a cost came out non-finite (never silently NaN).
    """
    with torch.no_grad():
        pd = plan.detach()
        rows, cols = (pd.sum(2), pd.sum(1)) if marginals is None else marginals
        err = (rows - a).abs().sum(1) + (cols - b).abs().sum(1)
        # eps * sum P log P through the marginals (log P = log a + log b + (f + g - C)/eps), so no
        # (batch, n, m) log is needed; padded rows have zero mass, so the clamped log is harmless.
        fd, gd, cd = f.detach(), g.detach(), cost.detach()
        eps_plogp = (
            (rows * (eps * _log_weights(a) + fd)).sum(1) + (cols * (eps * _log_weights(b) + gd)).sum(1) - cd
        )
        entropic = eps_plogp - eps * rows.sum(1)
    if not bool(torch.isfinite(cost.detach()).all()):
        bad = torch.nonzero(~torch.isfinite(cost.detach())).flatten()[:5].tolist()
        raise FloatingPointError(f"OT produced a non-finite cost in batch problem(s) {bad} (solver {solver})")
    converged = converged_mask(err, tol)
    if tol is not None and not bool(converged.all()):
        _warn_unconverged(solver, tol, done, err, converged)
    zero = torch.zeros((), dtype=f.dtype, device=f.device)
    return SinkhornResult(
        cost=cost,
        plan=plan,
        f=torch.where(a > 0, f, zero),
        g=torch.where(b > 0, g, zero),
        marginal_error=err,
        n_iters=done,
        converged=converged,
        # <P, C> - eps H(P): the entropy part is a detached constant, so with grad="envelope" the gradient
        # of reg_cost w.r.t. C is exactly P, as Danskin's theorem gives for the converged objective.
        reg_cost=cost + entropic,
        eps=eps,
        solver=solver,
    )
