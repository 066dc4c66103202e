"""Fixtures of the OT tests: run a test on both CPU paths of ``sinkhorn``'s envelope mode."""

import importlib

import pytest

from reprlab.ot import kernel

sk = importlib.import_module("reprlab.ot.sinkhorn")  # the module (reprlab.ot.sinkhorn is also a function)


@pytest.fixture(params=["compiled", "torch"])
def solver_path(request, monkeypatch):
    """The compiled kernel (``reprlab.ot.kernel``) and the PyTorch fallback path. The compiled case is skipped,
    with the reason, where the kernel cannot be built; test_kernel.py fails then if a compiler and ninja exist,
    so a broken build cannot hide behind the skip."""
    compiled = request.param == "compiled"
    if compiled and kernel.load() is None:
        pytest.skip(f"compiled kernel unavailable: {kernel.unavailable_reason()}")
    monkeypatch.setattr(sk, "COMPILED", compiled)
    return request.param


@pytest.fixture
def torch_path(monkeypatch):
    """Only the PyTorch path (tests of its internals: chunks, NumPy blocks, batched gemv)."""
    monkeypatch.setattr(sk, "COMPILED", False)
