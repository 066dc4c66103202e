"""The OT reference tests run on both CPU paths of ``sinkhorn`` (the compiled kernel and the PyTorch path)."""

from tests.unit.ot.conftest import solver_path  # noqa: F401
