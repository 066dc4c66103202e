"""Null baselines for ‖v‖²–IC correlations, and which conclusions survive them [all ours, docs/norm_ic.md].

A composition's norm can correlate with IC without the vectors carrying any information about the word:
rare words split into more subword pieces, and summing pieces grows the norm with their count. Three nulls
separate that from information in the vectors:

* **random vectors per piece**: every piece id gets a fixed random vector N(0, I/d) (``"gaussian"``) or a
  random unit vector (``"unit"``), the words are composed from them exactly as from the model's vectors,
  and ‖v‖² is correlated with IC. Whatever it finds comes from piece counts, SIF's frequency weights or the
  composition's algebra, never from the embedding. (Static tables: one random vector per word.)
* **piece count alone**: Spearman ρ(IC, number of pieces); undefined (n/a) for one-piece sources.
* **shuffled IC**: the permutation distribution of ρ with IC shuffled over words (``n_perm`` shuffles);
  its ``ci``-level interval is what ρ reaches by chance at this n.

A correlation *survives* in the direction of its sign when (a) ρ lies outside the shuffled interval and
(b) the paired bootstrap CI of ρ − ρ_null excludes 0 for the random-vector null and for the piece count
(same resampled words on both sides). Nulls that are undefined for a row are skipped and named.

Beating the piece count is a strict test: a norm can carry IC *beyond* the count and still correlate less
with IC than the count does. So each row also reports the partial Spearman ρ(IC, ‖v‖² | piece count) with its
bootstrap CI (information about IC within words of equal piece count), next to the same partial ρ of the
random-vector null (large for SIF, whose weights are a function of frequency); shown, not part of the verdict.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch
from scipy.stats import rankdata
from torch import Tensor

from reprlab.methods.norm_ic.compose import compose_all, fit_context
from reprlab.methods.norm_ic.sources import ItemSet
from reprlab.methods.norm_ic.stats import _pearson_rows, resample_ranks, spearman

NULL_VECTORS = ("gaussian", "unit")


def random_piece_vectors(ids: Tensor, d_model: int, seed: int, kind: str = "gaussian") -> Tensor:
    """One fixed random vector per distinct id: ``ids (n, pos)`` (padding < 0) → ``(n, pos, d_model)``.

    The vector of an id depends on ``seed`` and the id alone (not on which words are present), so the eval and
    fit sets, and every composition, see the same random table.
    """
    if kind not in NULL_VECTORS:
        raise ValueError(f"null vectors must be one of {NULL_VECTORS}, got {kind!r}")
    valid = ids >= 0
    uniq, inv = torch.unique(ids[valid], return_inverse=True)
    table = torch.empty(len(uniq), d_model, dtype=torch.float64)
    for k, t in enumerate(uniq.tolist()):  # per-id generator: the table does not depend on the id set
        g = torch.Generator().manual_seed(seed * 1_000_003 + int(t))
        table[k] = torch.randn(d_model, generator=g, dtype=torch.float64)
    table = table / (table.norm(dim=-1, keepdim=True) if kind == "unit" else d_model**0.5)
    out = torch.zeros(*ids.shape, d_model, dtype=torch.float64)
    out[valid] = table[inv]
    return out


@dataclass(frozen=True)
class NullResult:
    """One row's correlation against its nulls (Spearman throughout; NaN = that null is undefined)."""

    spearman: float
    shuffle_lo: float
    shuffle_hi: float
    random: float
    random_diff_lo: float
    random_diff_hi: float
    count: float
    count_diff_lo: float
    count_diff_hi: float
    count_partial: float
    count_partial_lo: float
    count_partial_hi: float
    random_partial: (
        float  # ρ(IC, ‖v_random‖² | count): what random pieces give within equal counts (SIF: a lot)
    )
    verdict: int  # +1 positive beyond every defined null, −1 negative beyond them, 0 not
    failed: str  # the nulls it does not beat, comma-separated ("" when it survives)

    def to_dict(self) -> dict:
        return {"null_" + k if k not in ("spearman", "verdict", "failed") else k: v
                for k, v in self.__dict__.items()}  # fmt: skip


def shuffle_interval(n: int, n_perm: int, ci: float, seed: int) -> tuple[float, float]:
    """``ci``-level interval of Spearman ρ between two untied length-``n`` rankings under random permutation.

    The distribution of ρ under a random permutation depends only on n (without ties), so one interval serves
    every row of a source; with ties it is slightly narrower, making this conservative.
    """
    rng = np.random.default_rng(seed + 17)
    base = np.arange(n, dtype=float)
    perm = np.argsort(rng.random((n_perm, n)), axis=1).astype(float)
    rho = _pearson_rows(np.broadcast_to(base, perm.shape), perm)
    q = (1 - ci) / 2
    return float(np.quantile(rho, q)), float(np.quantile(rho, 1 - q))


def _residual_rows(y: np.ndarray, z: np.ndarray) -> np.ndarray:
    """Row-wise OLS residuals of ``y`` on ``z`` (with intercept), both ``(b, n)``."""
    zc = z - z.mean(-1, keepdims=True)
    yc = y - y.mean(-1, keepdims=True)
    var = (zc * zc).sum(-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        beta = np.where(var > 0, (zc * yc).sum(-1, keepdims=True) / var, 0.0)
    return yc - beta * zc


def partial_spearman(x: np.ndarray, y: np.ndarray, z: np.ndarray) -> float:
    """Spearman ρ(x, y | z): Pearson of the ranks of x and y after removing the linear effect of z's ranks."""
    rx, ry, rz = (rankdata(v)[None] for v in (x, y, z))
    return float(_pearson_rows(_residual_rows(rx, rz), _residual_rows(ry, rz))[0])


def null_test(ic: np.ndarray, sq: np.ndarray, sq_random: np.ndarray | None, count: np.ndarray | None,
              shuffle: tuple[float, float], n_boot: int, ci: float, seed: int) -> NullResult:  # fmt: skip
    """Test one ‖v‖² column against the three nulls.

    Args:
        ic: ``(n,)`` information content; sq: ``(n,)`` ‖v‖² of the composition.
        sq_random: ``(n,)`` ‖v‖² of the same composition over random piece vectors, or None (e.g. CLS).
        count: ``(n,)`` pieces per word, or None; constant counts count as None.
        shuffle: the shuffled-IC interval from :func:`shuffle_interval`.
    """
    ic, sq = np.asarray(ic, float), np.asarray(sq, float)
    rho = spearman(ic, sq)
    rng = np.random.default_rng(seed + 29)
    idx = rng.integers(0, len(ic), size=(n_boot, len(ic)))
    r_ic, r_sq = resample_ranks(ic, idx), resample_ranks(sq, idx)  # each resample's ranks, reused below
    boot = _pearson_rows(r_ic, r_sq)
    q = (1 - ci) / 2
    out = {"spearman": rho, "shuffle_lo": shuffle[0], "shuffle_hi": shuffle[1]}
    for tag, other in (("random", sq_random), ("count", count)):
        if other is None or np.ptp(np.asarray(other, float)) == 0:
            out.update({tag: float("nan"), f"{tag}_diff_lo": float("nan"), f"{tag}_diff_hi": float("nan")})
            continue
        other = np.asarray(other, float)
        diff = boot - _pearson_rows(r_ic, resample_ranks(other, idx))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            lo, hi = np.nanquantile(diff, [q, 1 - q])
        out.update({tag: spearman(ic, other), f"{tag}_diff_lo": float(lo), f"{tag}_diff_hi": float(hi)})
    nan = float("nan")
    out.update(
        {"count_partial": nan, "count_partial_lo": nan, "count_partial_hi": nan, "random_partial": nan}
    )
    if count is not None and np.ptp(np.asarray(count, float)) > 0:
        c = np.asarray(count, float)
        rc = resample_ranks(c, idx)
        pb = _pearson_rows(_residual_rows(r_ic, rc), _residual_rows(r_sq, rc))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            lo, hi = np.nanquantile(pb, [q, 1 - q])
        out.update({"count_partial": partial_spearman(ic, sq, c), "count_partial_lo": float(lo),
                    "count_partial_hi": float(hi)})  # fmt: skip
        if sq_random is not None and np.ptp(np.asarray(sq_random, float)) > 0:
            out["random_partial"] = partial_spearman(ic, np.asarray(sq_random, float), c)
    verdict, failed = survival(out)
    return NullResult(**out, verdict=verdict, failed=failed)


def survival(r: dict) -> tuple[int, str]:
    """(+1 / −1 / 0, names of the nulls not beaten) for a dict with :class:`NullResult`'s fields."""
    rho = r["spearman"]
    if not np.isfinite(rho):
        return 0, "undefined"
    sign = 1 if rho > 0 else -1
    failed = []
    if not (rho > r["shuffle_hi"] if sign > 0 else rho < r["shuffle_lo"]):
        failed.append("shuffled IC")
    for tag, name in (("random", "random vectors"), ("count", "piece count")):
        lo, hi = r[f"{tag}_diff_lo"], r[f"{tag}_diff_hi"]
        if np.isnan(lo):
            continue
        if not (lo > 0 if sign > 0 else hi < 0):
            failed.append(name)
    return (0 if failed else sign), ", ".join(failed)


def piece_counts(mask: Tensor) -> np.ndarray:
    return mask.sum(1).numpy().astype(float)


def count_spearman(ic: np.ndarray, count: np.ndarray) -> float:
    """ρ(IC, piece count), NaN for constant counts."""
    return float("nan") if np.ptp(count) == 0 else spearman(ic, rankdata(count))


def random_null_vectors(ev: ItemSet, fit: ItemSet, comps: tuple[str, ...], acfg,
                        seed: int) -> tuple[dict[str, Tensor], dict[str, Tensor]]:  # fmt: skip
    """Every composition (but 'pooled') over random vectors per piece id (:mod:`nulls`): ``(eval, fit)`` dicts
    of ``(n, d_model)`` float64 tensors; the fit set lets a normalisation be fitted on the null like on the model."""
    if ev.ids is None or fit.ids is None:
        return {}, {}
    d = ev.x.shape[-1]
    rx_ev = random_piece_vectors(ev.ids, d, seed, acfg.null_vectors).float()
    rx_fit = random_piece_vectors(fit.ids, d, seed, acfg.null_vectors).float()
    rctx = fit_context(rx_fit, fit.mask, fit.p, acfg.sif_a)
    r_comps = tuple(c for c in comps if c != "pooled")
    out_ev = compose_all(r_comps, rx_ev, ev.mask, rctx, p=ev.p)
    out_fit = compose_all(r_comps, rx_fit, fit.mask, rctx, p=fit.p)
    return {c: v.double() for c, v in out_ev.items()}, {c: v.double() for c, v in out_fit.items()}
