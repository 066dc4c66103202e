"""Run the OT unit tests with one intra-op thread.

On the shared 2-core machine a torch op with 2 OpenMP threads can stall for a scheduler slice (~20 ms
measured for an exp of 270 elements at load ~11, vs 5 us at 1 thread), which made the autograd-path tests
slower than everything else combined. The numbers under test do not depend on the thread count.
"""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
