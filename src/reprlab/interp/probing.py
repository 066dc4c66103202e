"""Linear probes (scikit-learn logistic regression) on cached activations, over a (layer, position) grid.

Used to ask whether intermediate results (FDA carries and sum digits, THR bridge entities) are linearly
decodable, training on clean items and evaluating on held-out clean items and on noisy items against the
*true* intermediate values. Controls [ours]: a shuffled-label probe (selectivity: accuracy above it is
information in the representation, not probe capacity) and, by calling :func:`probe_grid` again on its
activations, a randomly initialised model.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression
from sklearn.preprocessing import StandardScaler
from threadpoolctl import threadpool_limits
from torch import Tensor, nn

from reprlab.hooks import run_with_cache


@torch.no_grad()
def collect(model: nn.Module, ids: Tensor, names: list[str], positions: list[int] | None = None,
            batch_size: int = 512) -> Tensor:  # fmt: skip
    """Activations of ``names`` at ``positions``: (n_names, batch, n_positions, d) float32 on CPU."""
    device = next(model.parameters()).device
    out = []
    for s in range(0, ids.shape[0], batch_size):
        _, cache = run_with_cache(model, ids[s : s + batch_size].to(device), names=names)
        acts = cache.stack(names)
        out.append((acts if positions is None else acts[:, :, positions]).float().cpu())
    return torch.cat(out, 1)


def fit_probe(x: np.ndarray, y: np.ndarray, seed: int = 0, c: float = 1.0):
    """Standardise + multinomial logistic regression; returns a fitted ``(scaler, classifier)``."""
    scaler = StandardScaler().fit(x)
    clf = LogisticRegression(C=c, max_iter=300, random_state=seed)
    # One BLAS thread: with torch loaded, multi-threaded BLAS inside lbfgs fights torch's OpenMP pool and
    # ran ~6x slower on our 2-core machine (measured 1.2 s vs 0.19 s per fit).
    with warnings.catch_warnings(), threadpool_limits(1):
        # lbfgs may stop at max_iter on separable data; accuracy is what we report, not the optimum
        warnings.simplefilter("ignore", ConvergenceWarning)
        clf.fit(scaler.transform(x), y)
    return scaler, clf


@dataclass(frozen=True)
class ProbeGridResult:
    """Probe accuracies for one target over layers x positions.

    Attributes:
        target: name of the probed variable.
        layers, positions: grid labels.
        acc: evaluation-set name -> (n_layers, n_positions) accuracy against the true target values.
        acc_shuffled: (n_layers, n_positions) accuracy on the first evaluation set of a probe trained on
            shuffled labels (selectivity control).
        majority: accuracy of predicting the majority training class (chance level).
        best: (layer index, position index) with the highest accuracy on the first evaluation set.
    """

    target: str
    layers: list[str]
    positions: list[int]
    acc: dict[str, np.ndarray]
    acc_shuffled: np.ndarray
    majority: float
    best: tuple[int, int]

    def to_json(self) -> dict:
        return {
            "target": self.target, "layers": self.layers, "positions": self.positions,
            "acc": {k: v.round(4).tolist() for k, v in self.acc.items()},
            "acc_shuffled": self.acc_shuffled.round(4).tolist(), "majority": self.majority,
            "best": list(self.best),
        }  # fmt: skip


def probe_grid(target: str, train_acts: Tensor, train_y: np.ndarray, evals: dict[str, tuple[Tensor, np.ndarray]],
               layers: list[str], positions: list[int], seed: int = 0,
               shuffle_control: bool = True) -> ProbeGridResult:  # fmt: skip
    """Fit one probe per (layer, position) and evaluate it.

    Args:
        target: name for the result.
        train_acts: (n_layers, n_train, n_positions, d) activations of clean training items.
        train_y: (n_train,) integer labels.
        evals: name -> ((n_layers, n_eval, n_positions, d) activations, (n_eval,) true labels); the first
            entry is the reference set for ``best`` and the shuffled control.
        layers, positions: labels of the grid axes.
    """
    if len(np.unique(train_y)) < 2:
        raise ValueError(f"probe target {target!r} has a single class in the training items")
    rng = np.random.default_rng(seed)
    shuffled = rng.permutation(train_y)
    n_l, _, n_p, _ = train_acts.shape
    acc = {k: np.zeros((n_l, n_p)) for k in evals}
    acc_sh = np.full((n_l, n_p), np.nan)
    first = next(iter(evals))
    for li in range(n_l):
        for pi in range(n_p):
            x = train_acts[li, :, pi].numpy()
            scaler, clf = fit_probe(x, train_y, seed)
            for k, (acts, y) in evals.items():
                acc[k][li, pi] = (clf.predict(scaler.transform(acts[li, :, pi].numpy())) == y).mean()
            if shuffle_control:
                sc, cl = fit_probe(x, shuffled, seed)
                ev_x, ev_y = evals[first]
                acc_sh[li, pi] = (cl.predict(sc.transform(ev_x[li, :, pi].numpy())) == ev_y).mean()
    best = np.unravel_index(np.argmax(acc[first]), acc[first].shape)
    majority = float(np.bincount(train_y).max() / len(train_y))
    return ProbeGridResult(target, layers, positions, acc, acc_sh, majority, (int(best[0]), int(best[1])))
