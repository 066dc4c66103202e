"""Unit tests of reprlab.ot.sinkhorn: invariants, padding, errors, warnings, gradients.

Oracles: mathematical invariants of entropic OT (marginals, equivariance, translation), the log-domain path
as reference for the scaling path (same iterates), finite differences for gradients. Reference-library
comparisons (POT, SciPy) live in tests/reference/test_ot_reference.py.
"""

import importlib
import warnings

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from reprlab.ot import kernel, sinkhorn

# `reprlab.ot.sinkhorn` the attribute is the function; the module is needed for helpers and CHUNK.
sk = importlib.import_module("reprlab.ot.sinkhorn")

F64 = torch.float64


def _problem(batch, n, m, seed=0, dtype=F64, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    C = torch.rand(batch, n, m, generator=g, dtype=dtype) * scale
    a = torch.rand(batch, n, generator=g, dtype=dtype) + 0.1
    b = torch.rand(batch, m, generator=g, dtype=dtype) + 0.1
    return C, a, b


shapes = st.tuples(st.integers(1, 3), st.integers(1, 7), st.integers(1, 7), st.integers(0, 10_000))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shapes, st.sampled_from([0.1, 0.3, 1.0]))
@example(shape=(2, 2, 4, 10_000), eps=0.1)  # found by hypothesis: 400 iterations left an L1 error of 3.5e-6
def test_marginals_match_weights_at_convergence(solver_path, shape, eps):
    batch, n, m, seed = shape
    C, a, b = _problem(batch, n, m, seed)
    # Run to convergence, not a fixed count: at eps 0.1 with cost range 1 the contraction factor can be close to 1
    # (the example above needs ~1,000 iterations), so each problem stops at its first check below 1e-10 (float64).
    r = sinkhorn(C, a, b, eps, n_iters=50_000, tol=1e-10)
    a_n, b_n = a / a.sum(1, keepdim=True), b / b.sum(1, keepdim=True)
    torch.testing.assert_close(r.plan.sum(2), a_n, atol=1e-8, rtol=0)
    torch.testing.assert_close(r.plan.sum(1), b_n, atol=1e-8, rtol=0)
    assert bool((r.marginal_error < 1e-8).all()) and bool(r.converged.all())
    assert bool((r.plan >= 0).all())


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shapes)
def test_permuting_points_permutes_plan(solver_path, shape):
    batch, n, m, seed = shape
    C, a, b = _problem(batch, n, m, seed)
    g = torch.Generator().manual_seed(seed + 1)
    pr, pc = torch.randperm(n, generator=g), torch.randperm(m, generator=g)
    r = sinkhorn(C, a, b, 0.2, n_iters=50)
    rp = sinkhorn(C[:, pr][:, :, pc], a[:, pr], b[:, pc], 0.2, n_iters=50)
    # Same iterates up to a relabelling; only summation order changes, so float64 rounding (1e-12).
    torch.testing.assert_close(rp.plan, r.plan[:, pr][:, :, pc], atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(rp.cost, r.cost, atol=1e-12, rtol=1e-10)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shapes)
def test_symmetric_cost_gives_symmetric_distance(solver_path, shape):
    batch, n, m, seed = shape
    C, a, b = _problem(batch, n, m, seed)
    # OT(a, b; C) = OT(b, a; C^T): a symmetric cost function gives a symmetric distance. The update order
    # differs between the two solves, so compare at convergence (300 iterations at eps = 0.3).
    r = sinkhorn(C, a, b, 0.3, n_iters=300)
    rt = sinkhorn(C.transpose(1, 2), b, a, 0.3, n_iters=300)
    torch.testing.assert_close(rt.cost, r.cost, atol=1e-10, rtol=0)
    torch.testing.assert_close(rt.plan, r.plan.transpose(1, 2), atol=1e-10, rtol=0)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shapes, st.floats(-3.0, 3.0))
def test_translating_cost_shifts_cost_by_constant(solver_path, shape, shift):
    batch, n, m, seed = shape
    C, a, b = _problem(batch, n, m, seed)
    r = sinkhorn(C, a, b, 0.2, n_iters=60)
    rs = sinkhorn(C + shift, a, b, 0.2, n_iters=60)
    # A constant moves both potentials' sum by the constant: the plan is unchanged and <P, C + c> gains
    # c * sum(P) = c. Iterates differ only by rounding of the shifted exponents (float64).
    torch.testing.assert_close(rs.plan, r.plan, atol=1e-10, rtol=0)
    torch.testing.assert_close(rs.cost, r.cost + shift, atol=1e-10, rtol=0)


def test_scaling_path_equals_log_domain_path(solver_path):
    C, a, b = _problem(5, 9, 6, seed=3)
    fast = sinkhorn(C, a, b, 0.05, n_iters=37, check_every=10)
    slow = sinkhorn(C, a, b, 0.05, n_iters=37, grad="autograd")
    assert fast.solver == "sinkhorn-scaling" and slow.solver == "sinkhorn-log"
    assert fast.n_iters == slow.n_iters == 37
    # Same iterates (module docstring); float64 rounding in exp/log of exponents up to 1/eps = 20.
    torch.testing.assert_close(fast.plan, slow.plan.detach(), atol=1e-12, rtol=1e-9)
    torch.testing.assert_close(fast.f, slow.f.detach(), atol=1e-10, rtol=0)
    torch.testing.assert_close(fast.g, slow.g.detach(), atol=1e-10, rtol=0)


@pytest.mark.parametrize("tol", [None, 1e-6])
def test_small_problem_path_equals_batched_gemv_path(monkeypatch, tol, torch_path):
    """Problems of <= SMALL_PROBLEM entries iterate with broadcast products; larger ones with bmm: the same
    iterates (float64: to rounding), with and without a tolerance (same stopping iteration)."""
    C, a, b = _problem(7, 9, 6, seed=4)
    b[2, 4:] = 0  # padding
    assert 9 * 6 <= sk.SMALL_PROBLEM
    small = sinkhorn(C, a, b, 0.05, n_iters=300, tol=tol)
    monkeypatch.setattr(sk, "SMALL_PROBLEM", 0)  # force the bmm path
    gemv = sinkhorn(C, a, b, 0.05, n_iters=300, tol=tol)
    assert small.solver == gemv.solver == "sinkhorn-scaling" and small.n_iters == gemv.n_iters
    torch.testing.assert_close(small.plan, gemv.plan, atol=1e-12, rtol=1e-9)
    torch.testing.assert_close(small.cost, gemv.cost, atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("tol", [None, 1e-6, 1e-3])
def test_numpy_small_path_equals_torch_small_path(monkeypatch, dtype, tol, torch_path):
    """NUMPY_SMALL runs the same blocks as the torch broadcast-product path with the weights folded into the
    kernels and a mat-vec convergence check: same iterates up to rounding, same stopping iteration, same
    outputs; padding included."""
    C, a, b = _problem(7, 9, 6, seed=11, dtype=dtype)
    a[1, 5:] = 0
    b[2, 4:] = 0
    assert sk.NUMPY_SMALL and 9 * 6 <= sk.SMALL_PROBLEM
    fast = sinkhorn(C, a, b, 0.05, n_iters=300, tol=tol)
    monkeypatch.setattr(sk, "NUMPY_SMALL", False)  # the torch small-problem path
    ref = sinkhorn(C, a, b, 0.05, n_iters=300, tol=tol)
    assert fast.solver == ref.solver == "sinkhorn-scaling" and fast.n_iters == ref.n_iters
    if tol is not None:
        assert fast.n_iters < 300  # stopped early, at the same check
    atol, rtol = (1e-12, 1e-9) if dtype == F64 else (1e-6, 1e-4)
    for field in ("plan", "cost", "f", "g", "marginal_error", "reg_cost"):
        torch.testing.assert_close(getattr(fast, field), getattr(ref, field), atol=atol, rtol=rtol)
    # exact: a decision; at the stopping check every error is >= 7% (relative) away from tol, the paths ~1e-6
    assert torch.equal(fast.converged, ref.converged)


def test_numpy_small_path_hands_over_to_the_log_domain_like_the_torch_path(monkeypatch, torch_path):
    C, a, b = _problem(4, 7, 5, seed=4, scale=2.0)
    a[1, 4:] = 0
    b[2, :3] = 0
    fast = sinkhorn(C, a, b, 1e-4, n_iters=30)
    monkeypatch.setattr(sk, "NUMPY_SMALL", False)
    ref = sinkhorn(C, a, b, 1e-4, n_iters=30)
    assert fast.solver == ref.solver == "sinkhorn-log" and fast.n_iters == ref.n_iters
    torch.testing.assert_close(fast.plan, ref.plan, atol=1e-12, rtol=1e-9)
    torch.testing.assert_close(fast.cost, ref.cost, atol=1e-12, rtol=1e-9)


def test_plan_is_gibbs_form_of_potentials(solver_path):
    C, a, b = _problem(3, 6, 4, seed=5)
    r = sinkhorn(C, a, b, 0.1, n_iters=30)
    a_n, b_n = a / a.sum(1, keepdim=True), b / b.sum(1, keepdim=True)
    torch.testing.assert_close(sk.gibbs_plan(C, a_n, b_n, r.f, r.g, 0.1), r.plan, atol=1e-12, rtol=1e-9)


def test_ragged_batch_equals_problems_one_at_a_time(solver_path):
    g = torch.Generator().manual_seed(7)
    batch, n, m = 6, 8, 5
    C = torch.rand(batch, n, m, generator=g, dtype=F64)
    n_valid = torch.tensor([8, 3, 1, 5, 8, 2])
    m_valid = torch.tensor([5, 5, 2, 1, 3, 4])
    a = (torch.arange(n)[None] < n_valid[:, None]).to(F64)
    b = (torch.arange(m)[None] < m_valid[:, None]).to(F64)
    C[a[:, :, None].expand(-1, -1, m) == 0] = float("nan")  # padded costs must be ignored, NaN included
    r = sinkhorn(C, a, b, 0.1, n_iters=40)
    for i in range(batch):
        k, j = int(n_valid[i]), int(m_valid[i])
        ri = sinkhorn(C[i, :k, :j], torch.ones(k, dtype=F64), torch.ones(j, dtype=F64), 0.1, n_iters=40)
        # Padded entries carry exactly zero mass, so the iterates coincide up to summation order.
        torch.testing.assert_close(r.cost[i], ri.cost, atol=1e-13, rtol=0)
        torch.testing.assert_close(r.plan[i, :k, :j], ri.plan, atol=1e-13, rtol=0)
        assert float(r.plan[i].sum()) == pytest.approx(1.0, abs=1e-12)
        assert bool((r.plan[i, k:] == 0).all()) and bool((r.plan[i, :, j:] == 0).all())
    assert torch.isfinite(r.f).all() and torch.isfinite(r.g).all()


def test_chunked_batch_equals_unchunked(monkeypatch, torch_path):
    C, a, b = _problem(11, 6, 4, seed=9)
    b[3, 2:] = 0
    whole = sinkhorn(C, a, b, 0.1, n_iters=25)
    monkeypatch.setattr(sk, "CHUNK", 4)  # chunk boundaries at 4 and 8, last chunk of 3
    chunked = sinkhorn(C, a, b, 0.1, n_iters=25)
    # other batch sizes may take other matmul kernels (another summation order): float64 rounding, entries <= 1
    torch.testing.assert_close(chunked.plan, whole.plan, atol=1e-14, rtol=0)
    torch.testing.assert_close(chunked.cost, whole.cost, atol=1e-14, rtol=0)


def test_all_padding_problem_raises_with_index(solver_path):
    C, a, b = _problem(4, 5, 3)
    b[2] = 0
    with pytest.raises(ValueError, match=r"all-padding.*\[2\]"):
        sinkhorn(C, a, b, 0.1)


def test_bad_inputs_raise_clear_errors(solver_path):
    C, a, b = _problem(2, 5, 3)
    with pytest.raises(ValueError, match="eps"):
        sinkhorn(C, a, b, 0.0)
    with pytest.raises(ValueError, match="weights must be"):
        sinkhorn(C, a[:, :4], b, 0.1)
    with pytest.raises(ValueError, match=">= 0"):
        sinkhorn(C, -a, b, 0.1)
    with pytest.raises(ValueError, match="grad"):
        sinkhorn(C, a, b, 0.1, grad="unrolled")
    C[1, 0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"non-finite cost.*\[1\]"):
        sinkhorn(C, a, b, 0.1)
    C32 = C.float().nan_to_num(0.0)
    C32[0, 2, 1] = float("inf")  # float32 takes the summed check: inf must be caught too
    with pytest.raises(ValueError, match=r"non-finite cost.*\[0\]"):
        sinkhorn(C32, a, b, 0.1)


def test_warns_when_tolerance_not_met(solver_path):
    C, a, b = _problem(3, 6, 5, seed=2)
    with pytest.warns(RuntimeWarning, match="did not reach tol"):
        r = sinkhorn(C, a, b, 0.01, n_iters=2, tol=1e-9)
    assert not bool(r.converged.all())


def test_tolerance_stops_early_without_warning(solver_path):
    C, a, b = _problem(3, 6, 5, seed=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = sinkhorn(C, a, b, 0.5, n_iters=1000, tol=1e-6, check_every=10)
    # eps = 0.5 on a unit cost range converges in a few tens of iterations, far below the cap.
    assert r.n_iters < 1000 and r.n_iters % 10 == 0
    assert bool(r.converged.all()) and float(r.marginal_error.max()) <= 1e-6


# Log-domain exponents are f/eps ~ 2/1e-4 = 2e4; float32 rounds them to ~2e4 * 6e-8 ~ 1e-3 absolute, which
# is the plan's relative error, so mass is 1 to ~1e-3 in float32 and to ~1e-11 in float64.
@pytest.mark.parametrize("dtype,mass_tol", [(torch.float32, 2e-3), (F64, 1e-10)])
def test_tiny_eps_never_nan(solver_path, dtype, mass_tol):
    C, a, b = _problem(4, 7, 5, seed=4, dtype=dtype, scale=2.0)
    a[1, 4:] = 0
    b[2, :3] = 0
    r = sinkhorn(C, a, b, 1e-4, n_iters=30)
    # exp(2 / 1e-4) overflows any float, so the scaling path must hand over to the log domain.
    assert r.solver == "sinkhorn-log"
    for field in (r.cost, r.plan, r.f, r.g, r.marginal_error, r.reg_cost):
        assert torch.isfinite(field).all()
    # Column marginals are exact after the last g update, so the mass is 1 up to rounding.
    torch.testing.assert_close(r.plan.sum((1, 2)), torch.ones(4, dtype=dtype), atol=mass_tol, rtol=0)


def test_envelope_gradient_is_the_plan(solver_path):
    C, a, b = _problem(3, 5, 4, seed=6)
    C.requires_grad_(True)
    w = torch.tensor([1.0, -2.0, 0.5], dtype=F64)
    r = sinkhorn(C, a, b, 0.1, n_iters=30)
    (r.cost * w).sum().backward()
    # exact: the backward is this product
    torch.testing.assert_close(C.grad, w[:, None, None] * r.plan, atol=0, rtol=0)
    assert not r.plan.requires_grad


def test_envelope_gradient_matches_finite_differences_of_the_objective(solver_path):
    # d/dC [min_P <P, C> - eps H(P)] = P* (Danskin), so finite differences of reg_cost must match the
    # envelope gradient once the solver has converged (eps = 1: 150 iterations reach machine precision).
    C, a, b = _problem(2, 4, 3, seed=8)
    C.requires_grad_(True)

    def objective(C):
        return sinkhorn(C, a, b, 1.0, n_iters=150).reg_cost

    assert torch.autograd.gradcheck(objective, (C,), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_autograd_gradient_matches_finite_differences():
    # grad="autograd" differentiates the finite-iteration map exactly, so gradcheck holds at any n_iters.
    C, a, b = _problem(2, 4, 3, seed=10)
    C.requires_grad_(True)

    def cost(C):
        return sinkhorn(C, a, b, 0.2, n_iters=7, grad="autograd").cost

    assert torch.autograd.gradcheck(cost, (C,), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_unbatched_inputs_give_unbatched_fields(solver_path):
    C, a, b = _problem(1, 5, 3, seed=11)
    r = sinkhorn(C[0], a[0], b[0], 0.1, n_iters=20)
    rb = sinkhorn(C, a, b, 0.1, n_iters=20)
    assert r.cost.shape == () and r.plan.shape == (5, 3) and r.f.shape == (5,) and r.converged.shape == ()
    # exact: unbatched inputs are unsqueezed to a batch of one
    torch.testing.assert_close(r.plan, rb.plan[0], atol=0, rtol=0)


def test_float32_fast_path_on_the_full_cosine_range(solver_path):
    # Worst case for the scaling domain at the OTCCLIP setting: costs at both ends of [0, 2] at eps = 0.05,
    # so kernel entries reach exp(-40) ~ 4e-18 (still a normal float32). The fast path must stay on the
    # scaling domain and agree with the float64 log-domain solve; 1e-5 is the benchmark's accuracy target.
    g = torch.Generator().manual_seed(12)
    C = 2.0 * (torch.rand(64, 49, 32, generator=g) > 0.5).float() + 0.01 * torch.rand(64, 49, 32, generator=g)
    C = C.clamp(0, 2)
    a, b = (
        torch.ones(64, 49),
        (torch.arange(32)[None] < torch.randint(4, 33, (64,), generator=g)[:, None]).float(),
    )
    fast = sinkhorn(C, a, b, 0.05, n_iters=50)
    ref = sinkhorn(C.double(), a.double(), b.double(), 0.05, n_iters=50, grad="autograd")
    assert fast.solver == "sinkhorn-scaling"
    assert float((fast.cost.double() - ref.cost.detach()).abs().max()) <= 1e-5


def _mixed_speed_batch(dtype=F64):
    """Problems that converge at very different iterations (at eps 0.02, tol 1e-4: random costs 130-390
    iterations, two copies of the same point cloud 10), with padding in both kinds."""
    C, a, b = _problem(6, 9, 6, seed=21, dtype=dtype)
    g = torch.Generator().manual_seed(22)
    x = torch.nn.functional.normalize(torch.randn(3, 6, 4, generator=g, dtype=dtype), dim=-1)
    slow = (1 - x @ x.transpose(1, 2)).clamp_min(0)  # (3, 6, 6): each point's twin costs 0
    C[3:, :6, :] = slow
    a[3:, 6:] = 0  # the slow problems are 6 x 6
    a[3:, :6], b[3:] = 1.0, 1.0
    b[1, 4:] = 0
    return C, a, b


@pytest.mark.parametrize("path", ["compiled", "numpy", "torch_small", "torch_bmm"])
@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_retired_problems_stop_where_each_problem_alone_stops(monkeypatch, path, dtype):
    """RETIRE_CONVERGED: with a tolerance every problem stops at its own first check below it, so a batch gives
    what each problem solved alone gives (the oracle: independent problems), on the compiled kernel and the
    three PyTorch scaling paths; the batch reports the largest iteration count. The old rule (the chunk runs
    until its slowest problem meets the tolerance; PyTorch path only) keeps iterating the fast problems, which
    the same comparison catches."""
    if path == "compiled" and kernel.load() is None:
        pytest.skip(f"compiled kernel unavailable: {kernel.unavailable_reason()}")
    monkeypatch.setattr(sk, "COMPILED", path == "compiled")
    monkeypatch.setattr(sk, "NUMPY_SMALL", path == "numpy")
    if path == "torch_bmm":
        monkeypatch.setattr(sk, "SMALL_PROBLEM", 0)
    C, a, b = _mixed_speed_batch(dtype)
    tol, eps = 1e-4, 0.02
    batch = sinkhorn(C, a, b, eps, n_iters=2000, tol=tol)
    alone = [sinkhorn(C[i : i + 1], a[i : i + 1], b[i : i + 1], eps, n_iters=2000, tol=tol) for i in range(6)]
    iters = [r.n_iters for r in alone]
    assert max(iters) >= 4 * min(iters)  # the fixture mixes fast and slow problems
    assert batch.solver == "sinkhorn-scaling" and batch.n_iters == max(iters)
    assert bool(batch.converged.all())
    atol, rtol = (1e-12, 1e-9) if dtype == F64 else (1e-6, 1e-4)
    for field in ("plan", "cost", "f", "g", "marginal_error", "reg_cost"):
        ref = torch.cat([getattr(r, field).reshape(1, *getattr(batch, field).shape[1:]) for r in alone])
        torch.testing.assert_close(getattr(batch, field), ref, atol=atol, rtol=rtol, msg=field)
    monkeypatch.setattr(sk, "RETIRE_CONVERGED", False)  # the old rule: the fast problems iterate on
    old = sinkhorn(C, a, b, eps, n_iters=2000, tol=tol)
    fast = [i for i in range(6) if iters[i] < max(iters)]
    assert not torch.allclose(old.f[fast], batch.f[fast], atol=atol * 10, rtol=0)


class _NumpyFailingAt:
    """``numpy`` for the solver module, except that its ``isfinite`` call number ``n`` reports nothing finite
    (forces the log-domain handover at a chosen block: two calls per block)."""

    def __init__(self, n):
        import numpy

        self.np, self.n, self.calls = numpy, n, 0

    def __getattr__(self, name):
        return getattr(self.np, name)

    def isfinite(self, x):
        self.calls += 1
        out = self.np.isfinite(x)
        return out & False if self.calls == self.n else out


def test_retirement_survives_the_log_domain_handover(monkeypatch, torch_path):
    """A chunk that retired problems at its first check and then over/underflows in the next block hands every
    problem to the log domain from the potentials it had after that check: the retired ones from their final
    potentials, which are the ones the old rule hands over too. So both rules give the same result."""
    C, a, b = _mixed_speed_batch()
    out = {}
    for retire in (True, False):
        monkeypatch.setattr(sk, "RETIRE_CONVERGED", retire)
        monkeypatch.setattr(sk, "np", _NumpyFailingAt(3))  # block 2's first check
        out[retire] = sinkhorn(C, a, b, 0.02, n_iters=2000, tol=1e-4)
        assert sk.np.calls >= 3
    new, old = out[True], out[False]
    assert new.solver == old.solver == "sinkhorn-log" and new.n_iters == old.n_iters
    assert bool(new.converged.all())
    for field in ("plan", "cost", "f", "g"):
        torch.testing.assert_close(getattr(new, field), getattr(old, field), atol=1e-12, rtol=1e-9)
