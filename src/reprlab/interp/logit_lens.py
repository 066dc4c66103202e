"""Logit lens (nostalgebraist 2020): decode every layer's residual stream through the final norm + unembed.

For the residual ``h_l`` at layer ``l`` (``l = 0`` is the embedding, ``l = i + 1`` is
``blocks.{i}.hook_resid_post``) and a chosen position ``p`` per item::

    probs_l = softmax(W_U · LN_final(h_l[p]))

and we report the probability and rank (0 = top-1) of two competing tokens per item, e.g. the true answer
token y* and the memorised noisy token ỹ at the first answer position where they differ [ours, for
Reason to Rote]. Works for our GPT and for HF causal LMs (hooks on decoder-layer inputs/outputs).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from reprlab.hooks import final_norm_and_unembed, n_layers, run_with_cache


@dataclass(frozen=True)
class LogitLensResult:
    """Per-layer statistics of two token sets.

    Attributes:
        layers: layer labels, ``embed`` then ``block0`` ... (length n_layers + 1).
        prob_a, prob_b: (n_layers + 1, batch) probabilities of token a (e.g. true) and b (e.g. noisy).
        rank_a, rank_b: (n_layers + 1, batch) ranks (0 = argmax).
        mean_prob_a, mean_prob_b: per-layer means.
        share_a_above_b: per layer, share of items where token a outranks token b.
        top1_a, top1_b: per layer, share of items where the token is the argmax.
    """

    layers: list[str]
    prob_a: np.ndarray
    prob_b: np.ndarray
    rank_a: np.ndarray
    rank_b: np.ndarray
    mean_prob_a: list[float]
    mean_prob_b: list[float]
    share_a_above_b: list[float]
    top1_a: list[float]
    top1_b: list[float]

    def to_json(self) -> dict:
        return {
            "layers": self.layers, "mean_prob_a": self.mean_prob_a, "mean_prob_b": self.mean_prob_b,
            "share_a_above_b": self.share_a_above_b, "top1_a": self.top1_a, "top1_b": self.top1_b,
            "median_rank_a": np.median(self.rank_a, axis=1).tolist(),
            "median_rank_b": np.median(self.rank_b, axis=1).tolist(), "n_items": int(self.prob_a.shape[1]),
        }  # fmt: skip


def residual_names(model: nn.Module) -> list[str]:
    """Hook names of the residual stream: input of block 0, then the output of every block."""
    n = n_layers(model)
    return ["blocks.0.hook_resid_pre"] + [f"blocks.{i}.hook_resid_post" for i in range(n)]


@torch.no_grad()
def logit_lens(model: nn.Module, ids: Tensor, positions: Tensor, tokens_a: Tensor, tokens_b: Tensor,
               batch_size: int = 512) -> LogitLensResult:  # fmt: skip
    """Decode each layer's residual at ``positions`` and score two tokens per item.

    Args:
        model: hooked GPT or HF causal LM (in eval mode).
        ids: (batch, pos) input ids (teacher-forced prefix up to each position).
        positions: (batch,) position whose next-token prediction is read.
        tokens_a, tokens_b: (batch,) token ids to score (e.g. true vs noisy answer token).
    """
    names = residual_names(model)
    norm, unembed = final_norm_and_unembed(model)
    device = next(model.parameters()).device
    probs_a, probs_b, ranks_a, ranks_b = [], [], [], []
    for s in range(0, ids.shape[0], batch_size):
        x = ids[s : s + batch_size].to(device)
        p = positions[s : s + batch_size].to(device)
        ta, tb = tokens_a[s : s + batch_size].to(device), tokens_b[s : s + batch_size].to(device)
        _, cache = run_with_cache(model, x, names=names)
        resid = cache.stack(names)[:, torch.arange(x.shape[0], device=device), p]  # (n_layers+1, b, d_model)
        logits = unembed(norm(resid)).float()  # (n_layers+1, b, d_vocab)
        probs = logits.softmax(-1)
        la, lb = logits.gather(-1, ta[None, :, None].expand(len(names), -1, 1)), logits.gather(
            -1, tb[None, :, None].expand(len(names), -1, 1))  # fmt: skip
        ranks_a.append((logits > la).sum(-1).cpu())
        ranks_b.append((logits > lb).sum(-1).cpu())
        probs_a.append(probs.gather(-1, ta[None, :, None].expand(len(names), -1, 1))[..., 0].cpu())
        probs_b.append(probs.gather(-1, tb[None, :, None].expand(len(names), -1, 1))[..., 0].cpu())
    pa, pb = torch.cat(probs_a, 1).numpy(), torch.cat(probs_b, 1).numpy()
    ra, rb = torch.cat(ranks_a, 1).numpy(), torch.cat(ranks_b, 1).numpy()
    labels = ["embed"] + [f"block{i}" for i in range(len(names) - 1)]
    return LogitLensResult(
        layers=labels, prob_a=pa, prob_b=pb, rank_a=ra, rank_b=rb,
        mean_prob_a=pa.mean(1).round(5).tolist(), mean_prob_b=pb.mean(1).round(5).tolist(),
        share_a_above_b=(ra < rb).mean(1).round(5).tolist(),
        top1_a=(ra == 0).mean(1).round(5).tolist(), top1_b=(rb == 0).mean(1).round(5).tolist(),
    )  # fmt: skip
