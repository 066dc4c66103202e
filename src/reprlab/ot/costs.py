"""Cost builders from batches of point sets.

Both builders accept ``(batch, n, d)`` / ``(batch, m, d)`` or unbatched ``(n, d)`` / ``(m, d)`` inputs and
return ``(batch, n, m)`` (or ``(n, m)``). Padded points (zero vectors, or anything) get a finite cost;
solvers ignore them through zero weights, so the builders need no masks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _check_pair(X: Tensor, Y: Tensor) -> None:
    if X.dim() not in (2, 3) or X.dim() != Y.dim():
        raise ValueError(
            f"X and Y must both be (n, d) or both (batch, n, d); got shapes {tuple(X.shape)} and {tuple(Y.shape)}"
        )
    if X.shape[-1] != Y.shape[-1]:
        raise ValueError(f"feature dims differ: X has d={X.shape[-1]}, Y has d={Y.shape[-1]}")
    if X.dim() == 3 and X.shape[0] != Y.shape[0]:
        raise ValueError(f"batch sizes differ: X has {X.shape[0]}, Y has {Y.shape[0]}")


def cosine_cost(X: Tensor, Y: Tensor) -> Tensor:
    """Cosine distance ``C_kl = 1 - cos(x_k, y_l)``, in ``[0, 2]``.

    Args:
        X: ``(batch, n, d)`` or ``(n, d)`` source points.
        Y: ``(batch, m, d)`` or ``(m, d)`` target points.

    Returns:
        ``(batch, n, m)`` (or ``(n, m)``) costs. A zero vector (typical padding) has cosine 0 with
        everything, so its cost is exactly 1 rather than NaN.
    """
    _check_pair(X, Y)
    # F.normalize clamps the norm at 1e-12, which is what keeps zero (padding) vectors finite.
    Xn = F.normalize(X, dim=-1)
    Yn = F.normalize(Y, dim=-1)
    # Rounding can push |cos| a hair above 1; clamp so the documented range [0, 2] holds exactly.
    return (1.0 - Xn @ Yn.transpose(-1, -2)).clamp_(0.0, 2.0)


def sq_euclidean_cost(X: Tensor, Y: Tensor) -> Tensor:
    """Squared Euclidean distance ``C_kl = |x_k - y_l|^2``.

    Computed as ``|x|^2 + |y|^2 - 2 x.y`` (one matmul) and clamped at 0, because cancellation can make
    the expansion slightly negative for coincident points.

    Args:
        X: ``(batch, n, d)`` or ``(n, d)`` source points.
        Y: ``(batch, m, d)`` or ``(m, d)`` target points.

    Returns:
        ``(batch, n, m)`` (or ``(n, m)``) non-negative costs.
    """
    _check_pair(X, Y)
    x2 = (X * X).sum(-1, keepdim=True)  # (batch, n, 1)
    y2 = (Y * Y).sum(-1).unsqueeze(-2)  # (batch, 1, m)
    return torch.clamp_min(x2 + y2 - 2.0 * (X @ Y.transpose(-1, -2)), 0.0)
