r"""Losses of CRL (triplet + KL retain) and of circuit breakers / representation rerouting (RR).

CRL [known: official code, ``code/methods/triplet``]. With trained states :math:`h'`, frozen states :math:`h`
(same model, adapters disabled) and the harmful centroid :math:`\mu'_h(\ell)` = mean of :math:`h'` over all
harmful response tokens of the batch at layer :math:`\ell`:

.. math::
    L_b = \mathrm{mean}\,\mathrm{ReLU}(d_p(h'_b, h_b) - d_n(h'_b, \mu'_h) + m_b), \qquad
    L_h = \mathrm{mean}\,\mathrm{ReLU}(d(h'_h, \mu'_h) - d(h'_h, h_h) + m_h),

    L_{KL} = T^2\,\mathrm{KL}(\mathrm{softmax}(z/T)\,\|\,\mathrm{softmax}(z'/T)), \qquad
    L = \alpha L_b + \beta L_h + \varepsilon L_{KL}.

Means run over layers and tokens (our CPU default [ours]; the paper (via TB) sums over layers).

RR [known: Zou et al. 2024, ``GraySwanAI/circuit-breakers``]: retain :math:`\|h' - h\|_2` on retain data,
reroute :math:`\mathrm{ReLU}(\cos(h', h))` on harmful data, weights :math:`c_r = \alpha t / (2N)` and
:math:`c_s = \alpha (1 - t / (2N))`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from reprlab.errors import ConfigError

DISTANCES = ("l2", "cosine", "sq_norm_l2", "mix")


def distance(a: Tensor, b: Tensor, kind: str) -> Tensor:
    """Row-wise distance between ``a`` and ``b`` (broadcast over leading dims) ``[..., d_model] -> [...]``.

    ``mix`` = L2 + 10 (1 - ReLU(cos)) as in the official code.
    """
    if kind == "l2":
        return (a - b).norm(dim=-1)
    if kind == "cosine":
        return 1.0 - F.cosine_similarity(a, b, dim=-1)
    if kind == "sq_norm_l2":
        return (F.normalize(a, dim=-1) - F.normalize(b, dim=-1)).pow(2).sum(-1)
    if kind == "mix":
        return (a - b).norm(dim=-1) + 10.0 * (1.0 - F.relu(F.cosine_similarity(a, b, dim=-1)))
    raise ValueError(f"distance must be one of {DISTANCES}, got {kind!r}")


def select_tokens(hidden: tuple[Tensor, ...] | list[Tensor], layers: list[int], mask: Tensor) -> Tensor:
    """Stack the masked token states of the chosen layers.

    Args:
        hidden: ``n_layers + 1`` tensors ``[batch, pos, d_model]``.
        mask: ``[batch, pos]`` bool, True on the tokens to keep.

    Returns:
        ``[len(layers), n_tokens, d_model]``.
    """
    return torch.stack([hidden[i][mask] for i in layers])


def last_token_mask(response_mask: Tensor) -> Tensor:
    """Keep only the last response token of each row (the "last" token-selection variant)."""
    out = torch.zeros_like(response_mask)
    has = response_mask.any(-1)
    out[has, -1] = True  # left padding: every response ends in the last column
    return out


def harmful_centroid(h_harm_trained: Tensor, detach: bool) -> Tensor:
    """``[layers, n_tok, d_model] -> [layers, 1, d_model]``; gradient flow is a flag ([unknown] in the paper)."""
    mu = h_harm_trained.mean(dim=1, keepdim=True)
    return mu.detach() if detach else mu


def crl_benign_loss(
    h_trained: Tensor, h_frozen: Tensor, mu_harm: Tensor, d_pos: str, d_neg: str, margin: float
) -> Tensor:
    """Benign triplet: anchor h′_b, positive h_b, negative μ′_h. Shapes ``[layers, n_tok, d]``, mu ``[layers, 1, d]``."""
    return F.relu(distance(h_trained, h_frozen, d_pos) - distance(h_trained, mu_harm, d_neg) + margin).mean()


def crl_harmful_loss(
    h_trained: Tensor, h_frozen: Tensor, mu_harm: Tensor, dist: str, margin: float
) -> Tensor:
    """Harmful triplet: anchor h′_h, positive μ′_h, negative h_h (pull together, push from the start)."""
    return F.relu(distance(h_trained, mu_harm, dist) - distance(h_trained, h_frozen, dist) + margin).mean()


def kl_retain(logits_frozen: Tensor, logits_trained: Tensor, temperature: float) -> Tensor:
    """``T² KL(softmax(z/T) || softmax(z'/T))`` averaged over token rows.

    Args:
        logits_frozen, logits_trained: ``[n_tok, d_vocab]`` (already restricted to the masked positions).
    """
    if logits_trained.shape[0] == 0:
        return logits_trained.sum() * 0.0
    logp = F.log_softmax(logits_frozen.float() / temperature, dim=-1)
    logq = F.log_softmax(logits_trained.float() / temperature, dim=-1)
    return temperature**2 * (logp.exp() * (logp - logq)).sum(-1).mean()


def kl_retain_batchmean(
    logits_frozen: Tensor, logits_trained: Tensor, mask: Tensor, temperature: float
) -> Tensor:
    """The code's retain KL: ``T² Σ_tokens KL(softmax(z/T) || softmax(z'/T)) / batch`` (``kl_div`` batchmean).

    A sum over each sequence's masked tokens, then a mean over sequences, so it grows with sequence length;
    :func:`kl_retain` is the per-token mean [ours].

    Args:
        logits_frozen, logits_trained: ``[batch, pos, d_vocab]``.
        mask: ``[batch, pos]`` bool, True on the tokens that count (the code: every non-pad token).
    """
    logp = F.log_softmax(logits_frozen.float() / temperature, dim=-1)
    logq = F.log_softmax(logits_trained.float() / temperature, dim=-1)
    per_tok = (logp.exp() * (logp - logq)).sum(-1)  # [batch, pos]
    return temperature**2 * (per_tok * mask.to(per_tok.dtype)).sum() / mask.shape[0]


RR_RETAIN_SCALES = ("l2", "relative")


def rr_retain_loss(h_trained: Tensor, h_frozen: Tensor, scale: str = "l2") -> Tensor:
    """Mean L2 distance between trained and frozen states ``[layers, n_tok, d]`` (RR retain).

    ``scale='l2'`` is CB's ``||h' - h||_2``; ``'relative'`` [ours] divides each token's distance by its frozen norm
    ``||h||_2``, which puts the retain gradient on the reroute cosine's ``1/||h||`` scale.
    """
    d = (h_trained - h_frozen).norm(dim=-1)
    if scale == "l2":
        return d.mean()
    if scale == "relative":
        return (d / h_frozen.norm(dim=-1).clamp_min(1e-6)).mean()
    raise ConfigError(f"rr retain_scale must be one of {RR_RETAIN_SCALES}, got {scale!r}")


def rr_reroute_loss(h_trained: Tensor, h_frozen: Tensor) -> Tensor:
    """Mean ReLU(cos(h′, h)) on harmful tokens (RR reroute): zero once states are orthogonal or opposed."""
    return F.relu(F.cosine_similarity(h_trained, h_frozen, dim=-1)).mean()


def rr_coefficients(step: int, total_steps: int, alpha: float) -> tuple[float, float]:
    """``(c_retain, c_reroute)`` at ``step``: α t/(2N) and α (1 − t/(2N)) (circuit-breakers schedule)."""
    frac = step / (2 * max(total_steps, 1))
    return alpha * frac, alpha * (1.0 - frac)
