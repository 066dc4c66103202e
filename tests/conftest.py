"""Shared fixtures. Tests never reach a model hub: offline flags are set before anything imports transformers."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("REPRLAB_QUIET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def seed() -> int:
    torch.manual_seed(0)
    return 0


@pytest.fixture
def device() -> torch.device:
    return torch.device("cpu")
