"""The compiled Sinkhorn kernel: built from source on first use, cached, with a clean fallback.

``csrc/sinkhorn_kernel.cpp`` solves each problem of a batch with its kernel and scalings resident in cache
(see the file's header and ``docs/ot.md``). It is plain C++ behind a C ABI: no torch headers, so it builds in
a few seconds and does not depend on torch's C++ ABI; it is called through :mod:`ctypes`, which releases the
GIL, so Python threads solve chunks of problems in parallel.

When [ours]: JIT on first use, not at install. ``pip install`` (editable or not) then needs no compiler and
the wheel stays pure Python; the kernel is compiled on the user's machine with the compiler it has, for the
instruction set that machine reports (``-mavx2 -mfma`` where torch reports AVX2 or AVX-512, else the
compiler's baseline), and cached by :func:`torch.utils.cpp_extension.load` under ``TORCH_EXTENSIONS_DIR``
(default ``~/.cache/torch_extensions``), rebuilt only when the source or the flags change; a file lock there
serialises concurrent first uses. ``python -m reprlab.ot.kernel`` builds it ahead of time and prints the
outcome (``make install`` runs it). If the build or the load fails (no C++ compiler, no ninja, anything
else), :func:`load` returns ``None``, logs the reason once at WARNING on the ``reprlab.ot`` logger, and
:func:`reprlab.ot.sinkhorn` uses its pure-PyTorch path. ``REPRLAB_OT_KERNEL=0`` turns the kernel off.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import torch

log = logging.getLogger("reprlab.ot")

# per-problem flags the kernel returns (bits)
USED_LOG = 1  # some block ran in the log domain (scalings over/underflowed)
NONFINITE_COST = 2  # a valid cost is inf or NaN: the problem was not solved
ABSORBED = 4  # scalings left [2^-30, 2^30] (float32) and were absorbed into the potentials
BAD_A, BAD_B = 8, 16  # a weight is negative, inf or NaN: the problem was not solved
EMPTY_A, EMPTY_B = 32, 64  # every weight is 0: the problem was not solved

SOURCE = Path(__file__).with_name("csrc") / "sinkhorn_kernel.cpp"
ABI_VERSION = 2  # must equal rl_ot_abi_version() in the source

_lock = threading.Lock()
_state: dict[str, object] = {}  # "lib": ctypes.CDLL | None, "reason": str | None, "isa": str


def isa_flags() -> tuple[str, list[str]]:
    """``(tag, compiler flags)`` for this CPU: AVX2+FMA where torch reports AVX2 or AVX-512, else baseline."""
    cap = torch.backends.cpu.get_cpu_capability()
    if cap in ("AVX2", "AVX512"):
        return "avx2", ["-mavx2", "-mfma"]
    return "generic", []


@contextlib.contextmanager
def _ninja_on_path():
    """cpp_extension runs ``ninja`` from PATH; a venv's ninja (the ``ninja`` package) is not on it when the venv's
    python is run without activating the venv, so put the package's binary folder on PATH for the build."""
    prev = os.environ.get("PATH", "")
    try:
        import ninja

        if shutil.which("ninja") is None:
            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + prev
    except ImportError:
        pass
    try:
        yield
    finally:
        os.environ["PATH"] = prev


def _build(verbose: bool = False) -> ctypes.CDLL:
    from torch.utils import cpp_extension

    tag, flags = isa_flags()
    with warnings.catch_warnings(), _ninja_on_path():
        warnings.simplefilter("ignore")  # cpp_extension's compiler-ABI notes do not apply to a C-ABI library
        path = cpp_extension.load(
            name=f"reprlab_ot_sinkhorn_{tag}",
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-ffp-contract=fast", *flags],
            is_python_module=False,
            verbose=verbose,
        )
    lib = ctypes.CDLL(str(path))
    if lib.rl_ot_abi_version() != ABI_VERSION:
        raise RuntimeError(f"stale kernel at {path}: ABI {lib.rl_ot_abi_version()}, expected {ABI_VERSION}")
    lib.rl_ot_isa.restype = ctypes.c_char_p
    i64, dbl, ptr = ctypes.c_int64, ctypes.c_double, ctypes.c_void_p
    lib.rl_ot_fma_probe.restype = ctypes.c_double
    lib.rl_ot_fma_probe.argtypes = [i64, ctypes.c_float]
    for fn in (lib.rl_ot_sinkhorn_f32, lib.rl_ot_sinkhorn_f64):
        fn.restype = ctypes.c_int
        fn.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64, dbl, i64, dbl, i64] + [ptr] * 8
    return lib


def load(verbose: bool = False) -> ctypes.CDLL | None:
    """The compiled kernel, built on first call; ``None`` (reason in :func:`unavailable_reason`) if it cannot
    be built or loaded, or ``REPRLAB_OT_KERNEL=0``."""
    if "lib" in _state:
        return _state["lib"]  # type: ignore[return-value]
    with _lock:
        if "lib" in _state:
            return _state["lib"]  # type: ignore[return-value]
        lib, reason = None, None
        if os.environ.get("REPRLAB_OT_KERNEL", "1") == "0":
            reason = "REPRLAB_OT_KERNEL=0"
        else:
            try:
                lib = _build(verbose)
            except Exception as e:  # any build or load failure means: use the PyTorch path
                first = (str(e).strip().splitlines() or [type(e).__name__])[-1]
                reason = f"{type(e).__name__}: {first}"
        if lib is None:
            log.warning(
                "reprlab.ot: compiled Sinkhorn kernel unavailable (%s); using the PyTorch path", reason
            )
        _state["lib"], _state["reason"] = lib, reason
        return lib


class KernelOutput(NamedTuple):
    """What :func:`solve` returns: ``plan (batch, n, m)`` (zeros at padding), potentials ``f (batch, n)``,
    ``g (batch, m)`` (zeros at padding), float64 per problem: ``cost`` ``<P, C>``, ``err`` the plan's L1 marginal
    error against the renormalised weights, ``ent`` ``eps * sum P (log P - 1)`` (so ``cost + ent`` is the
    entropic objective); ``iters (batch,)`` int32 iterations run per problem, ``flags (batch,)`` int32 bits
    (:data:`USED_LOG`, :data:`NONFINITE_COST`, :data:`ABSORBED`, :data:`BAD_A`, ...)."""

    plan: torch.Tensor
    f: torch.Tensor
    g: torch.Tensor
    cost: torch.Tensor
    err: torch.Tensor
    ent: torch.Tensor
    iters: torch.Tensor
    flags: torch.Tensor


_pool: ThreadPoolExecutor | None = None


def _thread_pool(workers: int) -> ThreadPoolExecutor:
    """One process-wide pool for the kernel's chunks (starting a pool per call costs ~0.1 ms)."""
    global _pool
    with _lock:
        if _pool is None or _pool._max_workers != workers:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(workers, thread_name_prefix="reprlab-ot")
        return _pool


def solve(
    lib: ctypes.CDLL,
    C: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    eps: float,
    n_iters: int,
    tol: float | None,
    check_every: int,
    parallel_work: int = 0,
) -> KernelOutput:
    """Run the kernel on a CPU batch: ``C (batch, n, m)``, non-negative weights ``a (batch, n)``, ``b (batch, m)``
    (zero = padding; renormalised per problem inside; a problem with a bad or all-zero side is flagged and not
    solved), all float32 or all float64.

    Chunks of problems run on ``torch.get_num_threads()`` Python threads (ctypes releases the GIL), a few chunks
    per thread so that a descheduled thread on a shared machine delays one chunk, not half the batch; below
    ``parallel_work`` entry-iterations (``batch * n * m * n_iters``) the calling thread does it all. Each
    problem is solved on its own, so the chunking never changes a result.
    """
    dtype = C.dtype
    if dtype not in (torch.float32, torch.float64) or a.dtype != dtype or b.dtype != dtype:
        raise TypeError(f"the compiled kernel takes float32 or float64 tensors of one dtype; got {C.dtype}")
    Cc, ac, bc = C.contiguous(), a.contiguous(), b.contiguous()
    batch, n, m = Cc.shape
    out = KernelOutput(
        plan=torch.empty(batch, n, m, dtype=dtype),
        f=torch.empty(batch, n, dtype=dtype),
        g=torch.empty(batch, m, dtype=dtype),
        cost=torch.empty(batch, dtype=torch.float64),
        err=torch.empty(batch, dtype=torch.float64),
        ent=torch.empty(batch, dtype=torch.float64),
        iters=torch.empty(batch, dtype=torch.int32),
        flags=torch.empty(batch, dtype=torch.int32),
    )
    fn = lib.rl_ot_sinkhorn_f64 if dtype == torch.float64 else lib.rl_ot_sinkhorn_f32
    head = (Cc.data_ptr(), ac.data_ptr(), bc.data_ptr())
    ptrs = [t.data_ptr() for t in out]
    tol_arg = -1.0 if tol is None else float(tol)

    def run(lo: int, hi: int) -> int:
        return fn(*head, lo, hi, n, m, float(eps), n_iters, tol_arg, check_every, *ptrs)

    workers = min(torch.get_num_threads(), batch)
    if workers <= 1 or batch * n * m * n_iters < parallel_work:
        status = [run(0, batch)]
    else:
        step = -(-batch // (4 * workers))
        status = list(
            _thread_pool(workers).map(lambda lo: run(lo, min(lo + step, batch)), range(0, batch, step))
        )
    if any(status):
        raise MemoryError("reprlab.ot compiled kernel: could not allocate its workspace")
    return out


def unavailable_reason() -> str | None:
    """Why :func:`load` returned ``None`` (after it was called), else ``None``."""
    return _state.get("reason")  # type: ignore[return-value]


def _reset_for_tests() -> None:
    _state.clear()


def main() -> None:
    """``python -m reprlab.ot.kernel``: build (or find in the cache) the kernel and say what happened."""
    lib = load(verbose=os.environ.get("VERBOSE") == "1")
    if lib is None:
        print(
            f"reprlab.ot compiled kernel: unavailable ({unavailable_reason()}); the PyTorch path will be used"
        )
    else:
        print(f"reprlab.ot compiled kernel: ok ({lib.rl_ot_isa().decode()}, {isa_flags()[0]} build)")


if __name__ == "__main__":
    main()
