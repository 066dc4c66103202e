"""Seeding: one seed per run, offset by the distributed rank so ranks draw different augmentations."""

from __future__ import annotations

import os
import random

import numpy as np
import torch


def seed_everything(seed: int, rank: int = 0, deterministic: bool = False) -> int:
    """Seed python, numpy and torch with ``seed + rank``; returns the seed used.

    Args:
        seed: the run's seed.
        rank: distributed rank (nanoGPT/open_clip convention: each rank gets its own stream).
        deterministic: also ask torch for deterministic kernels (slower; off by default).
    """
    s = int(seed) + int(rank)
    random.seed(s)
    np.random.seed(s % (2**32))
    torch.manual_seed(s)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    return s


def generator(seed: int) -> torch.Generator:
    """A private torch generator, so data order does not depend on how many random draws a model made."""
    g = torch.Generator()
    g.manual_seed(int(seed))
    return g
