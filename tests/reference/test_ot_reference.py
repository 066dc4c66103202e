"""reprlab.ot against reference solvers: POT (ot.sinkhorn2, ot.emd2, ot.batch) and SciPy's Hungarian solver.

Every Sinkhorn test runs on the compiled kernel and on the PyTorch path (``solver_path``, tests/unit/ot/conftest.py).
"""

import warnings

import numpy as np
import ot
import pytest
import torch
from scipy.optimize import linear_sum_assignment

from reprlab.ot import cosine_cost, ipot, ot_distance, sinkhorn

F64 = torch.float64


def _ragged_problem(seed, batch=6, n=9, m=7, uniform=False):
    g = torch.Generator().manual_seed(seed)
    C = torch.rand(batch, n, m, generator=g, dtype=F64)
    n_valid = torch.randint(1, n + 1, (batch,), generator=g)
    m_valid = torch.randint(1, m + 1, (batch,), generator=g)
    a = (torch.arange(n)[None] < n_valid[:, None]).to(F64) * (
        torch.rand(batch, n, generator=g, dtype=F64) + 0.5
    )
    b = (torch.arange(m)[None] < m_valid[:, None]).to(F64) * (
        torch.rand(batch, m, generator=g, dtype=F64) + 0.5
    )
    if uniform:
        a, b = (a > 0).to(F64), (b > 0).to(F64)
    return C, a, b, n_valid, m_valid


def _pot_sinkhorn_log(a, b, C, eps, n_iters):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # POT warns when stopThr=0 stops at numItermax, as intended here
        return float(ot.sinkhorn2(a, b, C, eps, method="sinkhorn_log", numItermax=n_iters, stopThr=0.0))


@pytest.mark.parametrize("eps", [0.05, 0.5])
def test_matches_pot_sinkhorn2_iteration_for_iteration(solver_path, eps):
    # POT's ot.sinkhorn updates g first; ours updates f first, so ours on (C^T, b, a) runs exactly POT's
    # iterates on (C, a, b). 20 iterations is far from convergence at eps = 0.05, so this pins the iteration
    # itself, not just the fixed point. POT starts from zero log-scalings, we from zero potentials; with
    # uniform weights the two starts differ by a constant (f + c, g - c), which leaves every plan unchanged.
    # float64 rounding only: 1e-12.
    C, a, b, n_valid, m_valid = _ragged_problem(0, uniform=True)
    r = sinkhorn(C.transpose(1, 2), b, a, eps, n_iters=20)
    for i in range(len(C)):
        k, j = int(n_valid[i]), int(m_valid[i])
        ai, bi = a[i, :k].numpy(), b[i, :j].numpy()
        ref = _pot_sinkhorn_log(ai / ai.sum(), bi / bi.sum(), C[i, :k, :j].numpy(), eps, 20)
        assert float(r.cost[i]) == pytest.approx(ref, abs=1e-12)


def test_matches_pot_sinkhorn2_at_convergence_and_plan(solver_path):
    C, a, b, n_valid, m_valid = _ragged_problem(1)
    r = sinkhorn(C, a, b, 0.2, n_iters=300)
    for i in range(len(C)):
        k, j = int(n_valid[i]), int(m_valid[i])
        ai, bi = a[i, :k].numpy(), b[i, :j].numpy()
        ai, bi = ai / ai.sum(), bi / bi.sum()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = ot.sinkhorn(
                ai, bi, C[i, :k, :j].numpy(), 0.2, method="sinkhorn_log", numItermax=300, stopThr=0
            )
        # Both converged (300 iterations at eps = 0.2 on a unit range): fixed points agree to rounding.
        np.testing.assert_allclose(r.plan[i, :k, :j].numpy(), plan, atol=1e-12)
        assert float(r.cost[i]) == pytest.approx(float((plan * C[i, :k, :j].numpy()).sum()), abs=1e-12)


def test_float32_fast_path_within_1e5_of_pot_float64(solver_path):
    # The benchmark's accuracy target: float32 (our hot path) against POT in float64, cosine costs of
    # random 128-d features, eps = 0.05, 50 iterations, ragged m. Rounding of f/eps ~ 20 in float32 gives
    # ~1e-6 relative error in the plan; 1e-5 is our accuracy target [ours].
    g = torch.Generator().manual_seed(2)
    X, Y = torch.randn(12, 49, 128, generator=g), torch.randn(12, 32, 128, generator=g)
    m_valid = torch.randint(4, 33, (12,), generator=g)
    y_mask = torch.arange(32)[None] < m_valid[:, None]
    r = ot_distance(X, Y, y_mask=y_mask, eps=0.05, n_iters=50)
    C = cosine_cost(X.double(), Y.double())
    for i in range(12):
        j = int(m_valid[i])
        ref = _pot_sinkhorn_log(
            np.full(j, 1 / j), np.full(49, 1 / 49), C[i, :, :j].T.numpy().copy(), 0.05, 50
        )
        assert float(r.cost[i]) == pytest.approx(ref, abs=1e-5)


def test_matches_pot_batch_solver(solver_path):
    # ot.batch.solve_batch uses our update order (f then g); with uniform weights its zero log-scaling
    # start equals ours up to a constant (see above). It has no padding, so all points are valid here.
    C = _ragged_problem(3, n=6, m=5)[0]
    a, b = torch.full((6, 6), 1 / 6, dtype=F64), torch.full((6, 5), 1 / 5, dtype=F64)
    res = ot.batch.solve_batch(C, reg=0.1, a=a, b=b, max_iter=30, tol=0.0, method="log_sinkhorn")
    r = sinkhorn(C, a, b, 0.1, n_iters=30)
    torch.testing.assert_close(r.cost, res.value_linear, atol=1e-12, rtol=0)


def test_small_eps_close_to_exact_emd(solver_path):
    # Entropic bias bound: <P_eps, C> - W <= eps * (H(P_eps) - H(P*)) <= eps * log(n m).
    C, a, b, n_valid, m_valid = _ragged_problem(4, batch=4, n=8, m=6)
    eps = 1e-3
    r = sinkhorn(C, a, b, eps, n_iters=3000)
    for i in range(len(C)):
        k, j = int(n_valid[i]), int(m_valid[i])
        ai, bi = a[i, :k].numpy(), b[i, :j].numpy()
        w = float(ot.emd2(ai / ai.sum(), bi / bi.sum(), C[i, :k, :j].numpy()))
        assert w - 1e-9 <= float(r.cost[i]) <= w + eps * np.log(k * j)


def test_low_eps_permutation_problem_matches_hungarian(solver_path):
    # Uniform weights on n = m points: the exact plan is a permutation / n (Birkhoff). At eps small
    # relative to the assignment gap the entropic plan concentrates on the Hungarian assignment.
    g = torch.Generator().manual_seed(5)
    n = 7
    C = torch.rand(3, n, n, generator=g, dtype=F64)
    r = sinkhorn(C, torch.ones(3, n, dtype=F64), torch.ones(3, n, dtype=F64), 2e-3, n_iters=3000)
    for i in range(3):
        rows, cols = linear_sum_assignment(C[i].numpy())
        assert r.plan[i].argmax(1).tolist() == cols.tolist()
        exact = float(C[i].numpy()[rows, cols].sum()) / n
        assert exact - 1e-9 <= float(r.cost[i]) <= exact + 2e-3 * np.log(n * n)


def test_ipot_converges_to_exact_emd():
    # IPOT's plan is a Gibbs plan at effective eps = beta / n_iters, so with beta = 0.5 and 300 iterations
    # the bound of test_small_eps_close_to_exact_emd gives |cost - W| <= (0.5 / 300) * log(n m).
    C, a, b, n_valid, m_valid = _ragged_problem(6, batch=4, n=8, m=6)
    r = ipot(C, a, b, beta=0.5, n_iters=300)
    for i in range(len(C)):
        k, j = int(n_valid[i]), int(m_valid[i])
        ai, bi = a[i, :k].numpy(), b[i, :j].numpy()
        w = float(ot.emd2(ai / ai.sum(), bi / bi.sum(), C[i, :k, :j].numpy()))
        assert abs(float(r.cost[i]) - w) <= 0.5 / 300 * np.log(k * j) + 1e-6
