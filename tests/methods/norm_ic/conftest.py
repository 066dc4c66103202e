"""Norm-IC tests run single-threaded: on the shared 2-core machine torch's OpenMP barriers stall against other
jobs, and one thread measured 7x faster than two for MiniLM extraction (benchmarks/bench_normic.py)."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
