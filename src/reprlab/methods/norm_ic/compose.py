r"""Composition functions: a padded sequence of vectors (subwords of a word, or words/tokens of a text) → one.

All functions take ``x: (n, pos, d_model)`` and ``mask: (n, pos)`` (True on real items, left-aligned) and
return ``(n, d_model)``.

* ``first``, ``sum``, ``mean``, ``max`` (element-wise): plain poolings.
* The paper's "scaled embedding average" has no known formula; three readings [ours]:
  ``scaled_a`` = √n·mean, so ‖·‖² = ‖Σv‖²/n; ``scaled_b`` = the mean's direction rescaled to √(Σ‖vᵢ‖²)
  (IND over all items); ``scaled_c`` = n·(mean − μ) = Σ(vᵢ − μ), μ fitted on a disjoint vocabulary.
* Information-theoretic composition (ICDS; Amigó et al. 2022, re-implemented from the published formula):

  .. math::
     F(x, y) = \sqrt{\max(\alpha(\|x\|^2+\|y\|^2) - \beta\langle x,y\rangle + (2\alpha+\beta)\log K,\,0)}
               \cdot \frac{\gamma x + y}{\|\gamma x + y\|}

  folded left to right (``*_rtl``: right to left), γ = 1, K = 1. Modes: ``icds_sum`` (α=1, β=−2),
  ``icds_avg`` (¼, −½), ``ind`` (1, 0), ``joint`` (1, 1), ``inf`` (1, min(‖x‖²,‖y‖²)/max(‖x‖²,‖y‖²)).
* Two readings of ICDS AVG, both α = ¼:

  - ``icds_avg`` [ours]: β = −½, so ‖F‖² = ¼‖x‖² + ¼‖y‖² + ½⟨x,y⟩ = ‖(x+y)/2‖², the recursive pairwise mean
    (the mode name's meaning);
  - ``icds_avg_ref``: β = +½, the value the public ICDS code's ``compose_LM('AVG')`` passes to its magnitude
    function α(‖x‖²+‖y‖²) − β⟨x,y⟩ + (2α+β)log K, so ‖F‖² = ‖(x−y)/2‖²: half the *difference*'s norm, which
    vanishes for x = y. The direction (x+y)/‖x+y‖ is the same in both. Which one the paper used is unknown.
* ``sif``: Arora et al. 2017 weights a/(a + p(item)), weighted sum over the number of non-zero weights;
  ``sif_pc`` additionally removes the projection on the first singular vector fitted on the fit set.
* ``pooled``: the model's own CLS/EOS state (passed in, not computed here).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

ICDS_MODES: dict[str, tuple[float, float | None]] = {
    "icds_sum": (1.0, -2.0),
    "icds_avg": (0.25, -0.5),  # [ours] ‖F‖² = ‖(x+y)/2‖²
    "icds_avg_ref": (0.25, 0.5),  # the public ICDS code's compose_LM('AVG'): ‖F‖² = ‖(x−y)/2‖²
    "ind": (1.0, 0.0),
    "joint": (1.0, 1.0),
    "inf": (1.0, None),  # β = min/max of the two squared norms, computed per pair
}
PLAIN = ("first", "sum", "mean", "max", "scaled_a", "scaled_b", "scaled_c")
ALL_COMPOSITIONS = (
    *PLAIN, *ICDS_MODES, "joint_rtl", "inf_rtl", "sif", "sif_pc", "pooled",
)  # fmt: skip


def _check(x: Tensor, mask: Tensor) -> Tensor:
    if x.ndim != 3 or mask.shape != x.shape[:2]:
        raise ValueError(
            f"expected x (n, pos, d_model) and mask (n, pos), got {tuple(x.shape)}, {tuple(mask.shape)}"
        )
    counts = mask.sum(1)
    if (counts == 0).any():
        raise ValueError(f"{int((counts == 0).sum())} sequences have no items (all-False mask rows)")
    return counts.to(x.dtype)


def masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask.unsqueeze(-1)).sum(1)


def icds_pair(
    x: Tensor, y: Tensor, alpha: float, beta: float | None, gamma: float = 1.0, k: float = 1.0
) -> Tensor:
    """ICDS composition of two batches of vectors ``(n, d_model)`` → ``(n, d_model)`` (formula in module doc)."""
    nx, ny = (x * x).sum(-1), (y * y).sum(-1)
    if beta is None:  # INF: β = min/max of squared norms, 0 if both vanish
        b = torch.minimum(nx, ny) / torch.maximum(nx, ny).clamp_min(1e-30)
    else:
        b = torch.full_like(nx, beta)
    sq = (alpha * (nx + ny) - b * (x * y).sum(-1) + (2 * alpha + b) * math.log(k)).clamp_min(0.0)
    direction = gamma * x + y
    dn = direction.norm(dim=-1, keepdim=True)
    # γx + y = 0 (e.g. y = −x): the direction is undefined; return 0 rather than NaN
    unit = torch.where(dn > 0, direction / dn.clamp_min(1e-30), torch.zeros_like(direction))
    return unit * sq.sqrt().unsqueeze(-1)


def reverse_valid(x: Tensor, mask: Tensor) -> Tensor:
    """Reverse each row's valid (left-aligned) items, leaving padding in place."""
    n, pos = mask.shape
    lengths = mask.sum(1, keepdim=True)
    j = torch.arange(pos).expand(n, pos)
    idx = torch.where(j < lengths, lengths - 1 - j, j)
    return x.gather(1, idx.unsqueeze(-1).expand_as(x))


def icds_fold(x: Tensor, mask: Tensor, mode: str, order: str = "ltr") -> Tensor:
    """Fold ICDS mode ``mode`` over the items, left to right (``order="ltr"``) or right to left."""
    _check(x, mask)
    alpha, beta = ICDS_MODES[mode]
    if order == "rtl":
        x = reverse_valid(x, mask)
    elif order != "ltr":
        raise ValueError(f"order must be 'ltr' or 'rtl', got {order!r}")
    acc = x[:, 0].clone()
    for t in range(1, int(mask.sum(1).max())):
        act = mask[:, t]  # only rows that still have items: short rows stop early
        acc[act] = icds_pair(acc[act], x[act, t], alpha, beta)
    return acc


def sif_weights(p: Tensor, a: float = 1e-3) -> Tensor:
    """SIF weights a/(a + p), same shape as ``p``."""
    return a / (a + p)


def first_singular_vector(v: Tensor) -> Tensor:
    """First right singular vector of ``v`` ``(n, d_model)``, uncentred as in the SIF reference code."""
    v64 = v.double()
    from reprlab.methods.norm_ic.normalize import single_thread

    with single_thread():
        _, evecs = torch.linalg.eigh(v64.T @ v64)  # top eigenvector of vᵀv = first right singular vector
    return evecs[:, -1].to(v.dtype)


def compose(
    name: str,
    x: Tensor,
    mask: Tensor,
    *,
    pooled: Tensor | None = None,
    mu: Tensor | None = None,
    p: Tensor | None = None,
    sif_a: float = 1e-3,
    pc: Tensor | None = None,
) -> Tensor:
    """Apply composition ``name``.

    Args:
        name: one of :data:`ALL_COMPOSITIONS`.
        x: ``(n, pos, d_model)`` item vectors, left-aligned.
        mask: ``(n, pos)`` bool.
        pooled: ``(n, d_model)`` CLS/EOS states, for ``name="pooled"``.
        mu: ``(d_model,)`` item mean fitted on the fit vocabulary, for ``scaled_c``.
        p: ``(n, pos)`` item probabilities, for ``sif``/``sif_pc``.
        sif_a: SIF's a.
        pc: ``(d_model,)`` unit first singular vector of the fit set's SIF vectors, for ``sif_pc``.
    """
    if name == "pooled":
        if pooled is None:
            raise ValueError("composition 'pooled' needs the model's CLS/EOS states (pooled=...)")
        return pooled
    count = _check(x, mask)
    if name == "first":
        return x[:, 0]
    if name == "sum":
        return masked_sum(x, mask)
    if name == "mean":
        return masked_sum(x, mask) / count[:, None]
    if name == "max":
        return x.masked_fill(~mask.unsqueeze(-1), float("-inf")).amax(1)
    if name == "scaled_a":
        return masked_sum(x, mask) / count.sqrt()[:, None]
    if name == "scaled_b":
        mean = masked_sum(x, mask) / count[:, None]
        target = masked_sum(x * x, mask).sum(-1).sqrt()
        mn = mean.norm(dim=-1)
        return mean * (target / mn.clamp_min(1e-30))[:, None]
    if name == "scaled_c":
        if mu is None:
            raise ValueError("composition 'scaled_c' needs mu fitted on the fit vocabulary")
        return masked_sum(x, mask) - count[:, None] * mu
    if name in ICDS_MODES:
        return icds_fold(x, mask, name, "ltr")
    if name in ("joint_rtl", "inf_rtl"):
        return icds_fold(x, mask, name.removesuffix("_rtl"), "rtl")
    if name in ("sif", "sif_pc"):
        if p is None:
            raise ValueError(f"composition {name!r} needs item probabilities p")
        w = sif_weights(p, sif_a) * mask
        v = (x * w.unsqueeze(-1)).sum(1) / (w > 0).sum(1).clamp_min(1)[:, None]
        if name == "sif_pc":
            if pc is None:
                raise ValueError("composition 'sif_pc' needs pc fitted on the fit vocabulary")
            v = v - (v @ pc)[:, None] * pc
        return v
    raise ValueError(f"unknown composition {name!r}; valid: {', '.join(ALL_COMPOSITIONS)}")


@dataclass(frozen=True)
class FitContext:
    """Quantities fitted on the fit vocabulary that some compositions need.

    Attributes:
        mu: ``(d_model,)`` mean item vector (``scaled_c``).
        pc: ``(d_model,)`` first singular vector of the fit set's SIF vectors (``sif_pc``).
        sif_a: SIF's a.
    """

    mu: Tensor
    pc: Tensor
    sif_a: float = 1e-3


def fit_context(x: Tensor, mask: Tensor, p: Tensor, sif_a: float = 1e-3) -> FitContext:
    """Fit :class:`FitContext` on fit-set items ``x (n, pos, d_model)``, ``mask``, probabilities ``p (n, pos)``."""
    count = _check(x, mask)
    mu = masked_sum(x, mask).sum(0) / count.sum()
    sif = compose("sif", x, mask, p=p, sif_a=sif_a)
    return FitContext(mu, first_singular_vector(sif), sif_a)


def compose_all(names: Sequence[str], x: Tensor, mask: Tensor, fit: FitContext, *, pooled: Tensor | None = None,
                p: Tensor | None = None) -> dict[str, Tensor]:  # fmt: skip
    """``{name: (n, d_model)}`` for every composition in ``names``."""
    return {
        name: compose(name, x, mask, pooled=pooled, mu=fit.mu, p=p, sif_a=fit.sif_a, pc=fit.pc)
        for name in names
    }
