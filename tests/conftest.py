"""Shared fixtures. Tests never reach a model hub: offline flags are set before anything imports transformers."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("REPRLAB_QUIET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_configure(config):
    """The CLI's third-party warning filters (reprlab.quiet) apply to tests too; our own warnings stay."""
    from reprlab.quiet import WARNING_FILTERS

    for spec in WARNING_FILTERS:
        config.addinivalue_line("filterwarnings", spec)


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    """Every test runs with one intra-op thread.

    The models under test are tiny, so they are latency-bound; on a shared 2-core machine a torch op with 2
    OpenMP threads can stall for a scheduler slice (~20 ms measured for an exp of 270 elements at load ~11, vs
    5 us at 1 thread). No number under test depends on the thread count.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="session")
def _close_run_locks_at_session_end():
    """Run folders a test leaves locked (a simulated crash keeps its lock, as a killed process would) have their
    lock files closed when the session ends, as the kernel does at a process's exit, instead of at interpreter
    teardown (one ResourceWarning per file)."""
    yield
    from reprlab.runs import lock

    for fh, *_ in list(lock._HELD.values()):
        fh.close()
    lock._HELD.clear()


@pytest.fixture
def seed() -> int:
    torch.manual_seed(0)
    return 0


@pytest.fixture
def device() -> torch.device:
    return torch.device("cpu")


@pytest.fixture(scope="session")
def micro_runs(tmp_path_factory):
    """Every method's micro variant, each run once per session on first use (tests/micro_runs.py), shared by
    the tests that need finished run folders: determinism (as its first run), Norm-IC's recipe tests, reports
    in a browser, standard JSON."""
    from tests.micro_runs import MicroRuns

    return MicroRuns(tmp_path_factory.mktemp("micro"))
