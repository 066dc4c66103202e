import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """For module-scoped run fixtures: they are set up before the per-test one-thread fixture, and a run
    compared bit for bit with a resumed one must use the same thread count (it changes float sums)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
