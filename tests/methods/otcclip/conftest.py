"""Fixtures for the OTCCLIP tests: tiny synthetic item images (no Fashion-MNIST read needed) (one intra-op thread comes from tests/conftest.py)."""

import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture
def items():
    """``(x uint8 (200, 28, 28), y (200,))``: class c is a bright square whose size grows with c."""
    rng = np.random.default_rng(0)
    y = np.arange(200) % 10
    x = np.zeros((200, 28, 28), np.uint8)
    for i, c in enumerate(y):
        s = 4 + 2 * c
        x[i, 14 - s // 2 : 14 + (s + 1) // 2, 14 - s // 2 : 14 + (s + 1) // 2] = 200
    x = np.clip(x.astype(int) + rng.integers(0, 30, x.shape), 0, 255).astype(np.uint8)
    return x, y
