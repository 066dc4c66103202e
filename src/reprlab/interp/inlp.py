"""INLP: Iterative Nullspace Projection (Ravfogel et al., ACL 2020, arXiv 2004.07667).

Repeat: fit a linear classifier ``W_i`` for the concept on ``P h``; add the (orthonormalised) rows of
``W_i`` to a basis ``B``; set ``P = I - B B^T``. Stop after ``n_iters`` or once held-out accuracy is within
``tol`` of the majority-class rate. At inference ``h <- P h`` (``P`` is symmetric, an orthogonal
projection), applied by :func:`project_out_hook` at the chosen hook and positions. The control removes a
random subspace of the same rank (:func:`random_projection`).

[ours] classifiers are scikit-learn logistic regressions on standardised features; the direction added
to the basis is the classifier's weight mapped back through the scaler (``w / scale``), so that ``P``
acts on the raw activations.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from reprlab.interp.probing import fit_probe


@dataclass(frozen=True)
class INLPResult:
    """Outcome of :func:`inlp`.

    Attributes:
        projection: (d, d) ``P = I - B B^T``.
        basis: (d, rank) orthonormal removed directions.
        accuracies: held-out probe accuracy before each iteration (first = original probe accuracy).
        majority: majority-class accuracy on the held-out split (chance).
        converged: whether accuracy reached ``majority + tol`` before ``n_iters``.
    """

    projection: Tensor
    basis: Tensor
    accuracies: list[float]
    majority: float
    converged: bool

    @property
    def rank(self) -> int:
        return self.basis.shape[1]


def inlp(x: np.ndarray, y: np.ndarray, n_iters: int = 10, tol: float = 0.02, heldout: float = 0.3,
         seed: int = 0, max_rank: int | None = None) -> INLPResult:  # fmt: skip
    """Find the nullspace projection removing the linearly decodable information about ``y`` from ``x``.

    Args:
        x: (n, d) activations.
        y: (n,) integer labels.
        n_iters: maximum classifiers to remove.
        tol: stop once held-out accuracy <= majority + tol.
        heldout: share of items used to measure accuracy after each removal.
        max_rank: cap on removed directions. A multi-class classifier contributes one direction per class,
            so with many classes (THR: one per person) and a small d the nullspace would otherwise swallow
            the whole space and the random control of equal rank would be just as destructive.
    """
    n, d = x.shape
    if n < 10:
        raise ValueError(f"INLP needs at least 10 items, got {n}")
    rng = np.random.default_rng(seed)
    perm = rng.permutation(n)
    n_ho = max(1, int(heldout * n))
    ho, tr = perm[:n_ho], perm[n_ho:]
    majority = float(np.bincount(y[ho]).max() / n_ho)
    basis = np.zeros((d, 0))
    accs: list[float] = []
    converged = False
    for _ in range(n_iters + 1):
        proj = np.eye(d) - basis @ basis.T
        xp = x @ proj
        scaler, clf = fit_probe(xp[tr], y[tr], seed)
        acc = float((clf.predict(scaler.transform(xp[ho])) == y[ho]).mean())
        accs.append(acc)
        if acc <= majority + tol:
            converged = True
            break
        if len(accs) > n_iters:
            break
        w = clf.coef_ / scaler.scale_[None, :]  # (n_classes or 1, d), directions in raw activation space
        w = w @ proj  # keep new directions inside the current nullspace
        q, _ = np.linalg.qr(np.concatenate([basis, w.T], axis=1))
        basis = q[:, : min(d, basis.shape[1] + np.linalg.matrix_rank(w))]
        if max_rank is not None and basis.shape[1] >= max_rank:
            basis = basis[:, :max_rank]  # QR keeps earlier directions first, so truncation drops the newest
            proj = np.eye(d) - basis @ basis.T
            xp = x @ proj
            scaler, clf = fit_probe(xp[tr], y[tr], seed)
            accs.append(float((clf.predict(scaler.transform(xp[ho])) == y[ho]).mean()))
            converged = accs[-1] <= majority + tol
            break
    proj = np.eye(d) - basis @ basis.T
    return INLPResult(torch.tensor(proj, dtype=torch.float32), torch.tensor(basis, dtype=torch.float32),
                      accs, majority, converged)  # fmt: skip


def random_projection(d: int, rank: int, seed: int = 0) -> Tensor:
    """``I - Q Q^T`` for a uniformly random rank-``rank`` orthonormal ``Q`` (d, rank): the INLP control."""
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d, max(rank, 1), generator=gen))
    q = q[:, :rank]
    return torch.eye(d) - q @ q.T


def project_out_hook(projection: Tensor, positions: Tensor | list[int] | None = None):
    """Hook ``fn(act, name)`` applying ``act[:, positions] <- act[:, positions] @ P`` (all positions if None).

    Args:
        projection: (d, d) symmetric projection.
        positions: sequence positions; a (batch,) tensor gives one position per item.
    """

    def fn(act: Tensor, _name: str) -> Tensor:
        p = projection.to(act.device, act.dtype)
        out = act.clone()
        if positions is None:
            return act @ p
        pos = torch.as_tensor(positions, device=act.device)
        if pos.ndim == 1 and pos.shape[0] == act.shape[0] and not isinstance(positions, list):
            rows = torch.arange(act.shape[0], device=act.device)
            out[rows, pos] = act[rows, pos] @ p
        else:
            out[:, pos] = act[:, pos] @ p
        return out

    return fn
