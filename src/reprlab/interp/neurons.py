"""Outlier-heuristic neurons: feature-conditional activation statistics, z-scores, and patch-back.

Reason to Rote (arXiv 2507.04782) reports that in FDA, memorisation of noisy labels works through
*outlier heuristics*: existing neuron activation patterns (Nikankin et al. 2025, arXiv 2410.21272,
"arithmetic heuristics") are slightly shifted to fit the noisy labels. Our test [ours]:

1. rank the neurons of a (late) MLP layer by attribution on noisy items (from attribution patching);
2. for each neuron n, answer position j and feature value v (FDA: the column sum a_k + b_k + carry-in
   that determines the digit predicted at j), compute μ_n(j, v) and σ_n(j, v) over clean items;
3. z-score noisy items: z = (a_n(x) − μ_n(j, f_j(x))) / σ_n(j, f_j(x)), against held-out clean items;
4. patch the top-K neurons to μ_n(j, f_j(x)) at every answer position and measure the *restoration rate*
   (share of noisy items whose greedy answer becomes the true answer) and the remaining memorisation;
5. controls: K random neurons of the same layer, and the clean-item EM under the same patch.

Matched nulls [ours, docs/reason_to_rote.md]: a raw restoration rate counts items that already answered y* before the
patch (in a run that has not finished memorising that is most of it), so every rate is also reported as a
*gain* over the pre-patch true-answer rate, and the headline ``restore_gain_net`` subtracts the larger gain
of two random controls: ``n_random`` uniform draws of K neurons, and ``n_random`` draws of K neurons from
attribution ranks [K, 4K) (active, relevant-looking neurons that are not the top K).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from reprlab.hooks import hooks, run_with_cache
from reprlab.models.hf_lm import argmax_from


@dataclass(frozen=True)
class ConditionalStats:
    """μ and σ of each neuron per (position, feature value): mean/std of shape (n_pos, n_values, d_mlp)."""

    mean: Tensor
    std: Tensor
    count: Tensor  # (n_pos, n_values) clean items per cell

    def lookup(self, features: Tensor) -> tuple[Tensor, Tensor]:
        """(batch, n_pos) feature values -> μ, σ of shape (batch, n_pos, d_mlp)."""
        pos = torch.arange(features.shape[1])
        return self.mean[pos, features], self.std[pos, features]


@torch.no_grad()
def neuron_acts(model: nn.Module, ids: Tensor, hook: str, positions: list[int]) -> Tensor:
    """(batch, n_pos, d_mlp) activations of ``hook`` at ``positions``."""
    device = next(model.parameters()).device
    _, cache = run_with_cache(model, ids.to(device), names=[hook])
    return cache[hook][:, positions].float().cpu()


def conditional_stats(
    acts: Tensor, features: Tensor, n_values: int, min_std: float = 1e-3
) -> ConditionalStats:
    """Feature-conditional neuron statistics over clean items.

    Args:
        acts: (batch, n_pos, d_mlp) clean activations.
        features: (batch, n_pos) integer feature value per item and position, in [0, n_values).
        min_std: floor on σ so that near-constant neurons do not give infinite z-scores.

    Cells with fewer than 2 items fall back to the position's overall mean/std.
    """
    _, n_pos, d = acts.shape
    mean = torch.zeros(n_pos, n_values, d)
    std = torch.ones(n_pos, n_values, d)
    count = torch.zeros(n_pos, n_values, dtype=torch.long)
    for j in range(n_pos):
        overall_m, overall_s = acts[:, j].mean(0), acts[:, j].std(0).clamp_min(min_std)
        for v in range(n_values):
            sel = acts[features[:, j] == v, j]
            count[j, v] = sel.shape[0]
            if sel.shape[0] >= 2:
                mean[j, v], std[j, v] = sel.mean(0), sel.std(0).clamp_min(min_std)
            else:
                mean[j, v], std[j, v] = overall_m, overall_s
    return ConditionalStats(mean, std, count)


def patch_to_conditional_mean(hook_positions: list[int], neurons: Tensor, target: Tensor):
    """Hook setting ``neurons`` at ``hook_positions`` to per-item values ``target`` (batch, n_pos, K)."""

    def fn(act: Tensor, _name: str) -> Tensor:
        out = act.clone()
        pos = torch.as_tensor(hook_positions, device=act.device)
        idx = neurons.to(act.device)
        sub = out[:, pos]  # (b, n_pos, d_mlp)
        sub[..., idx] = target.to(act.device, act.dtype)
        out[:, pos] = sub
        return out

    return fn


@dataclass(frozen=True)
class OutlierNeuronResult:
    """Outcome of :func:`outlier_neuron_analysis` (rates are shares of items, in [0, 1]).

    Attributes:
        hook: the MLP hook analysed; neurons: the top-K neuron indices (by attribution).
        z_noisy_abs, z_clean_abs: mean |z| of the top-K neurons on noisy vs held-out clean items at the
            first differing position (clean: at the same positions distribution).
        z_noisy_by_neuron: mean z per top neuron on noisy items (signed).
        restore_rate: noisy items answering the true answer after patching the top-K neurons.
        restore_rate_random: same with K random neurons (control; mean over ``n_random`` draws).
        restore_rate_random_matched: same with K neurons drawn from attribution ranks [K, 4K) (mean).
        restore_gain: restore_rate - true_before (what the patch adds).
        restore_gain_net: restore_gain minus the larger random-control gain (the headline).
        memorized_after, memorized_before: noisy-label EM with and without the top-K patch.
        true_before: noisy items already answering the true answer without a patch.
        clean_em_before, clean_em_after: held-out clean EM without and with the top-K patch.
    """

    hook: str
    neurons: list[int]
    z_noisy_abs: float
    z_clean_abs: float
    z_noisy_by_neuron: list[float]
    restore_rate: float
    restore_rate_random: float
    restore_rate_random_matched: float
    restore_rate_random_draws: list[float]
    restore_gain: float
    restore_gain_net: float
    memorized_before: float
    memorized_after: float
    true_before: float
    clean_em_before: float
    clean_em_after: float


def _em(model, ids, start: int, length: int, fwd_hooks=()) -> Tensor:
    """Teacher-forced exact match of the answer span [start, start+length) (= greedy-decode EM)."""
    device = next(model.parameters()).device
    x = ids.to(device)
    with torch.no_grad(), hooks(model, list(fwd_hooks)):
        pred = argmax_from(model, x, start - 1)
    ok = pred[:, start - 1 : start + length - 1] == x[:, start : start + length]
    return ok.all(1).cpu()


def outlier_neuron_analysis(
    model: nn.Module, hook: str, ranking: Tensor, k: int, positions: list[int], answer_start: int,
    answer_len: int, clean_ids: Tensor, clean_features: Tensor, heldout_ids: Tensor, heldout_features: Tensor,
    noisy_ids: Tensor, noisy_true_ids: Tensor, noisy_features: Tensor, noisy_diff_pos: Tensor, n_values: int,
    seed: int = 0, n_random: int = 5,
) -> OutlierNeuronResult:  # fmt: skip
    """Run steps 2-5 of the module docstring for fixed-length answers (FDA).

    Args:
        hook: MLP neuron hook, e.g. ``blocks.1.mlp.hook_post``.
        ranking: (d_mlp,) importance of each neuron (higher = more important).
        k: neurons to patch.
        positions: sequence positions that predict the answer tokens (answer_start - 1 + j).
        clean_ids / clean_features: clean training items for μ, σ: (n, pos) and (n, n_pos).
        heldout_ids / heldout_features: held-out clean items (z baseline and clean-EM control).
        noisy_ids / noisy_true_ids: noisy items with their noisy / true answers; noisy_features (m, n_pos).
        noisy_diff_pos: (m,) index into ``positions`` of the first answer token where labels differ.
        n_random: draws of each random-neuron control.
    """
    stats = conditional_stats(neuron_acts(model, clean_ids, hook, positions), clean_features, n_values)
    top = ranking.topk(k).indices
    gen = torch.Generator().manual_seed(seed)
    d_mlp = ranking.shape[0]
    rands = [torch.randperm(d_mlp, generator=gen)[:k] for _ in range(n_random)]
    pool = ranking.argsort(descending=True)[k : min(4 * k, d_mlp)]
    matched = (
        [pool[torch.randperm(len(pool), generator=gen)[:k]] for _ in range(n_random)] if len(pool) else []
    )

    def zscores(ids: Tensor, feats: Tensor, at: Tensor) -> Tensor:
        acts = neuron_acts(model, ids, hook, positions)
        mu, sd = stats.lookup(feats)
        z = (acts - mu) / sd  # (b, n_pos, d_mlp)
        return z[torch.arange(z.shape[0]), at][:, top]  # (b, K) at one position per item

    z_noisy = zscores(noisy_ids, noisy_features, noisy_diff_pos)
    gen_pos = torch.Generator().manual_seed(seed + 1)
    clean_at = noisy_diff_pos[torch.randint(len(noisy_diff_pos), (heldout_ids.shape[0],), generator=gen_pos)]
    z_clean = zscores(heldout_ids, heldout_features, clean_at)

    def patch_hooks(neurons: Tensor, feats: Tensor):
        mu, _ = stats.lookup(feats)
        return [(hook, patch_to_conditional_mean(positions, neurons, mu[..., neurons]))]

    em = lambda ids, h=(): _em(model, ids, answer_start, answer_len, h).float().mean().item()  # noqa: E731
    true_before = em(noisy_true_ids)
    restore = em(noisy_true_ids, patch_hooks(top, noisy_features))
    draws = [em(noisy_true_ids, patch_hooks(r, noisy_features)) for r in rands]
    draws_m = [em(noisy_true_ids, patch_hooks(r, noisy_features)) for r in matched]
    rand_mean = sum(draws) / len(draws) if draws else float("nan")
    matched_mean = sum(draws_m) / len(draws_m) if draws_m else float("nan")
    null = max(v for v in (rand_mean, matched_mean, true_before) if v == v)  # NaN-safe max
    return OutlierNeuronResult(
        hook=hook, neurons=top.tolist(),
        z_noisy_abs=z_noisy.abs().mean().item(), z_clean_abs=z_clean.abs().mean().item(),
        z_noisy_by_neuron=z_noisy.mean(0).round(decimals=4).tolist(),
        restore_rate=restore, restore_rate_random=rand_mean, restore_rate_random_matched=matched_mean,
        restore_rate_random_draws=[round(v, 4) for v in draws + draws_m],
        restore_gain=restore - true_before, restore_gain_net=restore - null,
        memorized_before=em(noisy_ids), memorized_after=em(noisy_ids, patch_hooks(top, noisy_features)),
        true_before=true_before,
        clean_em_before=em(heldout_ids), clean_em_after=em(heldout_ids, patch_hooks(top, heldout_features)),
    )  # fmt: skip
