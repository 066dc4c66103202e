"""The compiled Sinkhorn kernel (reprlab.ot.kernel) against the PyTorch path, the log-domain iteration and itself.

Oracles: the PyTorch path and the log-domain (autograd) path run the same iterates, so they agree up to
rounding; problems are independent, so a problem solved in a batch, alone, or in another chunk or thread gives
the same numbers (the same code on the same data: bitwise). The fallback when no compiler exists is checked in a
subprocess with a compiler that does not exist.
"""

import importlib
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from reprlab.ot import kernel, sinkhorn

sk = importlib.import_module("reprlab.ot.sinkhorn")
F64 = torch.float64


@pytest.fixture
def lib():
    lib = kernel.load()
    if lib is None:
        pytest.skip(f"compiled kernel unavailable: {kernel.unavailable_reason()}")
    return lib


def _ragged(batch, n, m, seed, dtype=F64, scale=1.0, prefix=False):
    """Random costs with ragged padding: valid rows/columns anywhere (zero weights in the middle too) unless
    ``prefix``; every problem keeps at least one valid point per side."""
    g = torch.Generator().manual_seed(seed)
    C = torch.rand(batch, n, m, generator=g, dtype=dtype) * scale
    a = torch.rand(batch, n, generator=g, dtype=dtype) + 0.1
    b = torch.rand(batch, m, generator=g, dtype=dtype) + 0.1
    if prefix:
        a = a * (torch.arange(n)[None] < torch.randint(1, n + 1, (batch, 1), generator=g))
        b = b * (torch.arange(m)[None] < torch.randint(1, m + 1, (batch, 1), generator=g))
    else:
        a = a * (torch.rand(batch, n, generator=g) > 0.3)
        b = b * (torch.rand(batch, m, generator=g) > 0.3)
        a[:, 0] += 0.5  # at least one valid point (not always the first: it is only made non-zero)
        b[:, -1] += 0.5
    C[(a[:, :, None] == 0).expand(-1, -1, m)] = float("nan")  # padded costs must never be read
    return C, a, b


def test_kernel_builds_where_a_compiler_and_ninja_exist():
    """The compiled path's tests skip when the kernel is unavailable; this one fails instead if a C++ compiler
    and ninja are present, so a build broken on a machine that can build it cannot hide behind the skips."""
    from torch.utils.cpp_extension import is_ninja_available

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None or not is_ninja_available():
        pytest.skip(f"no C++ compiler ({compiler}) or no ninja here: the fallback path is what runs")
    assert kernel.load() is not None, kernel.unavailable_reason()


@pytest.mark.parametrize("shape", [(7, 9, 6), (4, 70, 131), (3, 1, 1), (5, 17, 1), (2, 1, 40)])
@pytest.mark.parametrize("tol", [None, 1e-7])
@pytest.mark.parametrize("prefix", [False, True])
def test_compiled_equals_pytorch_path_float64(lib, monkeypatch, shape, tol, prefix):
    """Same iterates, absorption points aside (both reparametrise, neither changes the iterates): float64
    rounding only. Shapes cover the register-block remainders (n, m not multiples of the vector width, more
    than 8 vectors), single points, and padding at the end or anywhere."""
    C, a, b = _ragged(*shape, seed=sum(shape), prefix=prefix)
    fast = sinkhorn(C, a, b, 0.05, n_iters=300, tol=tol)
    monkeypatch.setattr(sk, "COMPILED", False)
    ref = sinkhorn(C, a, b, 0.05, n_iters=300, tol=tol)
    assert fast.solver == ref.solver == "sinkhorn-scaling" and fast.n_iters == ref.n_iters
    # float64: exponents up to 1/eps = 20, a few hundred iterations of products: 1e-12 absolute on plan entries
    for field in ("plan", "cost", "f", "g", "marginal_error", "reg_cost"):
        torch.testing.assert_close(
            getattr(fast, field), getattr(ref, field), atol=1e-11, rtol=1e-9, msg=field
        )
    assert torch.equal(fast.converged, ref.converged)


def test_compiled_and_pytorch_path_float32_against_float64(lib, monkeypatch):
    """The benchmark's shape at a few problems, both float32 paths against the float64 solve of the same costs.
    float32 rounding of exponents up to 40 (cosine cost at eps 0.05) is ~2e-6 relative on plan entries (~0.02):
    3e-8 absolute; costs and potentials (about 1) to 2e-6 (measured: compiled 6e-8 / 2e-7, PyTorch path 1e-6 /
    3e-7 on cost / potentials)."""
    g = torch.Generator().manual_seed(3)
    X, Y = torch.randn(16, 49, 128, generator=g), torch.randn(16, 32, 128, generator=g)
    C = 1 - torch.nn.functional.normalize(X, dim=-1) @ torch.nn.functional.normalize(Y, dim=-1).transpose(
        1, 2
    )
    a = torch.ones(16, 49)
    b = (torch.arange(32)[None] < torch.randint(4, 33, (16, 1), generator=g)).float()
    ref = sinkhorn(C.double(), a.double(), b.double(), 0.05, n_iters=50)
    for compiled in (True, False):
        monkeypatch.setattr(sk, "COMPILED", compiled)
        r = sinkhorn(C, a, b, 0.05, n_iters=50)
        for field, atol in (
            ("cost", 2e-6),
            ("f", 2e-6),
            ("g", 2e-6),
            ("plan", 3e-8),
            ("marginal_error", 2e-6),
        ):
            got = getattr(r, field).double()
            torch.testing.assert_close(got, getattr(ref, field), atol=atol, rtol=0, msg=f"{field} {compiled}")


def test_problems_are_independent_of_batch_chunk_and_thread(lib, monkeypatch):
    """Each problem is solved by the same code on the same data whatever its neighbours, its chunk or the
    thread that runs it: bitwise equal."""
    C, a, b = _ragged(40, 12, 9, seed=4, dtype=torch.float32)
    one = sinkhorn(C, a, b, 0.1, n_iters=500, tol=1e-5)
    monkeypatch.setattr(sk, "KERNEL_PARALLEL_WORK", 0)  # chunks on worker threads even for this small batch
    torch.set_num_threads(2)  # the autouse fixture restores it
    threaded = sinkhorn(C, a, b, 0.1, n_iters=500, tol=1e-5)
    alone = sinkhorn(C[7:8], a[7:8], b[7:8], 0.1, n_iters=500, tol=1e-5)
    for field in ("plan", "cost", "f", "g", "marginal_error"):
        assert torch.equal(getattr(threaded, field), getattr(one, field)), field
        assert torch.equal(getattr(alone, field)[0], getattr(one, field)[7]), field


def test_log_domain_blocks_only_where_needed(lib):
    """eps = 1e-4 on costs spanning [0, 2]: kernel entries down to exp(-2e4) underflow even in float64, so such
    problems can need blocks in the log domain (here one of the three: absorption carries the others); problems
    with costs in [0, 0.02] (exponents down to -200) stay in the scaling domain. Both match the log-domain iteration (grad="autograd") to float64 rounding of exponents up to
    2e4 (~1e-12 relative on the plan's exponent terms: 1e-9 on plan entries and potentials); the scaling problems
    equal their solve alone bitwise."""
    C, a, b = _ragged(6, 8, 7, seed=5, scale=2.0)
    C[3:] = C[3:] / 100
    r = sinkhorn(C, a, b, 1e-4, n_iters=60)
    ref = sinkhorn(C, a, b, 1e-4, n_iters=60, grad="autograd")
    assert r.solver == "sinkhorn-log"
    for field in ("plan", "cost", "f", "g"):
        torch.testing.assert_close(getattr(r, field), getattr(ref, field).detach(), atol=1e-9, rtol=1e-7)
    out = kernel.solve(lib, C, a / a.sum(1, keepdim=True), b / b.sum(1, keepdim=True), 1e-4, 60, None, 10)
    assert (out.flags[:3] & kernel.USED_LOG).any() and not (out.flags[3:] & kernel.USED_LOG).any()
    alone = sinkhorn(C[3:4], a[3:4], b[3:4], 1e-4, n_iters=60)
    assert alone.solver == "sinkhorn-scaling" and torch.equal(alone.plan[0], r.plan[3])


def test_absorption_when_scalings_leave_their_range(lib):
    """float32, eps = 0.02, one column costing 0.5 more than the rest: its scaling grows to ~e^25 > 2^30, so the
    kernel absorbs it into the potentials (and does not need the log domain). The result matches the float64
    log-domain iteration within float32 rounding of exponents up to ~75 (~5e-6 relative)."""
    g = torch.Generator().manual_seed(6)
    C = torch.rand(4, 10, 8, generator=g) * 0.3
    C[:, :, 2] += 0.5
    a, b = torch.ones(4, 10), torch.ones(4, 8)
    out = kernel.solve(lib, C, a / 10, b / 8, 0.02, 100, None, 10)
    assert (out.flags & kernel.ABSORBED).all() and not (out.flags & kernel.USED_LOG).any()
    r = sinkhorn(C, a, b, 0.02, n_iters=100)
    ref = sinkhorn(C.double(), a.double(), b.double(), 0.02, n_iters=100, grad="autograd")
    assert r.solver == "sinkhorn-scaling"
    torch.testing.assert_close(r.cost.double(), ref.cost.detach(), atol=5e-6, rtol=0)
    torch.testing.assert_close(r.g.double(), ref.g.detach(), atol=5e-6, rtol=0)


@pytest.mark.parametrize("dtype, atol", [(torch.bfloat16, 4e-3), (torch.float16, 5e-4)])
def test_half_precision_costs_are_solved_in_float32(solver_path, dtype, atol):
    """bf16 / fp16 costs: the solve runs in float32 on the upcast costs and every field is rounded back, so the
    result equals the float32 solve rounded (same code on the same data: bitwise) and the cost is within the
    format's rounding of a cost near 1 (bf16: 2^-8, fp16: 2^-11, plus the input's own rounding) of the float64
    solve of the same rounded costs. The envelope gradient reaches the half-precision costs."""
    C, a, b = _ragged(8, 9, 7, seed=7, dtype=torch.float32)
    C = torch.nan_to_num(C, nan=1.0).to(dtype).requires_grad_()
    r = sinkhorn(C, a, b, 0.05, n_iters=50)
    r32 = sinkhorn(C.detach().float(), a, b, 0.05, n_iters=50)
    assert r.cost.dtype == r.plan.dtype == r.f.dtype == dtype
    for field in ("cost", "plan", "f", "g", "marginal_error", "reg_cost"):
        assert torch.equal(getattr(r, field), getattr(r32, field).to(dtype)), field
    ref = sinkhorn(C.detach().double(), a.double(), b.double(), 0.05, n_iters=50)
    torch.testing.assert_close(r.cost.double(), ref.cost, atol=atol, rtol=0)
    r.cost.sum().backward()
    assert C.grad.dtype == dtype
    torch.testing.assert_close(C.grad, r32.plan.to(dtype), atol=0, rtol=0)


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv("REPRLAB_OT_KERNEL", "0")
    kernel._reset_for_tests()
    try:
        assert kernel.load() is None and kernel.unavailable_reason() == "REPRLAB_OT_KERNEL=0"
        C, a, b = _ragged(3, 5, 4, seed=8)
        assert sinkhorn(C, a, b, 0.1, n_iters=20).solver == "sinkhorn-scaling"  # the PyTorch path
    finally:
        kernel._reset_for_tests()  # the next load finds the cached build


_CHILD = textwrap.dedent(
    """
    import json, logging, sys, torch
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    from reprlab.ot import kernel, sinkhorn
    from tests.unit.ot.test_kernel import _ragged
    C, a, b = _ragged(5, 9, 6, seed=9)
    r = sinkhorn(C, a, b, 0.05, n_iters=80)
    print(json.dumps({"reason": kernel.unavailable_reason(), "cost": r.cost.tolist(), "solver": r.solver}))
    """
)


def test_falls_back_with_a_logged_reason_without_a_compiler(lib, tmp_path):
    """A machine without a C++ compiler (CXX pointing nowhere, an empty extension cache): the build fails, the
    reason is logged once, and sinkhorn runs the PyTorch path, which agrees with the compiled kernel to float64
    rounding (1e-12 on costs of about 1)."""
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    child = json.loads(proc.stdout.strip().splitlines()[-1])
    assert child["reason"] and "compiled Sinkhorn kernel unavailable" in proc.stderr
    assert proc.stderr.count("compiled Sinkhorn kernel unavailable") == 1
    C, a, b = _ragged(5, 9, 6, seed=9)
    here = sinkhorn(C, a, b, 0.05, n_iters=80)
    torch.testing.assert_close(torch.tensor(child["cost"], dtype=F64), here.cost, atol=1e-12, rtol=0)
