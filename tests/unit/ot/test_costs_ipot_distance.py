"""Cost builders, IPOT and ot_distance.

Oracles: SciPy's cdist for the costs, UNITER's IPOT code (transcribed below from ChenRocks/UNITER,
model/ot.py, unpadded case) for IPOT, and sinkhorn() itself for the ot_distance wrapper.
"""

import importlib

import pytest
import torch
from scipy.spatial.distance import cdist

from reprlab.ot import cosine_cost, ipot, ot_distance, sinkhorn, sq_euclidean_cost

F64 = torch.float64
sk = importlib.import_module("reprlab.ot.sinkhorn")


def test_costs_match_scipy_cdist():
    g = torch.Generator().manual_seed(0)
    X, Y = torch.randn(2, 5, 4, generator=g, dtype=F64), torch.randn(2, 3, 4, generator=g, dtype=F64)
    for i in range(2):
        # float64 matmul-based formulas vs SciPy's direct ones: rounding only.
        torch.testing.assert_close(
            cosine_cost(X, Y)[i], torch.from_numpy(cdist(X[i], Y[i], "cosine")), atol=1e-12, rtol=0
        )
        torch.testing.assert_close(
            sq_euclidean_cost(X, Y)[i], torch.from_numpy(cdist(X[i], Y[i], "sqeuclidean")), atol=1e-12, rtol=0
        )
    # unbatched vs batched matmul: other kernels may sum in another order (2.2e-16 seen on an AVX-512 Xeon);
    # costs are in [0, 2], so 1e-14 is a few dozen float64 ulps
    torch.testing.assert_close(cosine_cost(X[0], Y[0]), cosine_cost(X, Y)[0], atol=1e-14, rtol=0)


def test_cost_edge_cases():
    X = torch.tensor([[1.0, 0.0], [0.0, 0.0], [-2.0, 0.0]])
    C = cosine_cost(X, X)
    # Zero vectors (padding) get cost exactly 1, opposite vectors 2, identical 0: never NaN. Exact on any CPU:
    # every operand and partial result here (0, +-1, 2, 4) is exactly representable, so no step rounds.
    assert C[1].tolist() == [1.0, 1.0, 1.0] and C[0, 2] == 2.0 and C[0, 0] == 0.0
    assert float(sq_euclidean_cost(X, X).diagonal().abs().max()) == 0.0
    with pytest.raises(ValueError, match="feature dims"):
        cosine_cost(torch.zeros(3, 2), torch.zeros(3, 4))


def _uniter_ipot(C, beta=0.5, iteration=50, k=1):
    """UNITER's ipot() without padding, C: (batch, n, m); rows get delta, columns sigma."""
    batch, n, m = C.shape
    sigma = torch.ones(batch, m, 1, dtype=C.dtype) / m
    T = torch.ones(batch, n, m, dtype=C.dtype)
    A = torch.exp(-C / beta)
    for _ in range(iteration):
        Q = A * T
        for _ in range(k):
            delta = 1 / (n * Q.matmul(sigma).view(batch, 1, n))
            sigma = (1 / (m * delta.matmul(Q))).view(batch, m, 1)
        T = delta.view(batch, n, 1) * Q * sigma.view(batch, 1, m)
    return T


@pytest.mark.parametrize("inner_iters", [1, 3])
def test_ipot_matches_uniter_code(inner_iters):
    C = torch.rand(3, 6, 4, generator=torch.Generator().manual_seed(1), dtype=F64) * 2
    r = ipot(C, torch.ones(3, 6, dtype=F64), torch.ones(3, 4, dtype=F64), inner_iters=inner_iters)
    # Our row-minimum shift of C is a diagonal rescaling of the kernel that the scalings absorb exactly.
    torch.testing.assert_close(r.plan, _uniter_ipot(C, k=inner_iters), atol=1e-14, rtol=1e-10)
    assert r.solver == "ipot" and r.n_iters == 50 and r.eps == pytest.approx(0.5 / 50)


def test_ipot_ragged_potentials_and_gradient():
    g = torch.Generator().manual_seed(2)
    C = torch.rand(3, 6, 5, generator=g, dtype=F64)
    a = torch.ones(3, 6, dtype=F64)
    b = torch.ones(3, 5, dtype=F64)
    a[1, 4:] = 0
    b[2, 2:] = 0
    C.requires_grad_(True)
    r = ipot(C, a, b, n_iters=40)
    for i, (k, j) in enumerate([(6, 5), (4, 5), (6, 2)]):
        ri = ipot(C[i, :k, :j].detach(), torch.ones(k, dtype=F64), torch.ones(j, dtype=F64), n_iters=40)
        torch.testing.assert_close(r.plan[i, :k, :j], ri.plan, atol=1e-14, rtol=1e-10)
    a_n, b_n = a / a.sum(1, keepdim=True), b / b.sum(1, keepdim=True)
    # Potentials are the Gibbs form of the plan at eps = beta / n_iters (unrolled IPOT); the exponents are
    # ~1/eps_eff = 80, so float64 reconstruction is good to ~1e-12 relative.
    torch.testing.assert_close(
        sk.gibbs_plan(C.detach(), a_n, b_n, r.f, r.g, r.eps), r.plan, atol=1e-12, rtol=1e-9
    )
    r.cost.sum().backward()
    # exact: the envelope backward returns grad_out * plan, and grad_out is exactly 1 here
    torch.testing.assert_close(C.grad, r.plan, atol=0, rtol=0)


def test_ot_distance_equals_sinkhorn_on_built_costs():
    g = torch.Generator().manual_seed(3)
    X, Y = torch.randn(4, 6, 8, generator=g, dtype=F64), torch.randn(4, 5, 8, generator=g, dtype=F64)
    x_mask = torch.ones(4, 6, dtype=torch.bool)
    x_mask[0, 3:] = False
    y_mask = torch.arange(5)[None] < torch.tensor([5, 1, 3, 4])[:, None]
    X.requires_grad_(True)
    for cost, fn in [("cosine", cosine_cost), ("sqeuclidean", sq_euclidean_cost)]:
        r = ot_distance(X, Y, x_mask, y_mask, eps=0.1, cost=cost, n_iters=30)
        ref = sinkhorn(fn(X, Y), x_mask.to(F64), y_mask.to(F64), 0.1, n_iters=30)
        # exact: the same calls on the same tensors
        torch.testing.assert_close(r.cost, ref.cost, atol=0, rtol=0)
    r.cost.sum().backward()
    # Padded points get no gradient (their weights and plan rows are zero); valid ones do.
    assert X.grad[0, 3:].abs().max() == 0 and X.grad[0, :3].abs().max() > 0
    ri = ot_distance(X.detach(), Y, x_mask, y_mask, eps=0.5, solver="ipot", n_iters=20)
    refi = ipot(cosine_cost(X.detach(), Y), x_mask.to(F64), y_mask.to(F64), beta=0.5, n_iters=20)
    torch.testing.assert_close(ri.cost, refi.cost, atol=0, rtol=0)  # exact: the same calls, as above


def test_ot_distance_errors():
    X, Y = torch.randn(2, 3, 4), torch.randn(2, 5, 4)
    with pytest.raises(ValueError, match="solver"):
        ot_distance(X, Y, solver="emd")
    with pytest.raises(ValueError, match="cost"):
        ot_distance(X, Y, cost="manhattan")
    with pytest.raises(ValueError, match="bool"):
        ot_distance(X, Y, x_mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"all-padding.*\[1\]"):
        ot_distance(X, Y, y_mask=torch.tensor([[True] * 5, [False] * 5]))
