"""Learning-rate schedules."""

from __future__ import annotations

import math

import torch


def warmup_cosine_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float = 0.1) -> float:
    """Multiplier at ``step``: linear warm-up to 1, then cosine decay to ``min_ratio`` at ``total_steps``."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_cosine(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, min_ratio: float = 0.1
) -> torch.optim.lr_scheduler.LambdaLR:
    """``LambdaLR`` with linear warm-up then cosine decay; its state is saved with the optimizer's step."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine_factor(step, warmup_steps, total_steps, min_ratio)
    )
