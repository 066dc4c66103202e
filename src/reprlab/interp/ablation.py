"""Head ablation: the change of a metric when one attention head's output is replaced by its mean (or zero).

Head ablation sits next to the attribution-patching circuits (Reason to Rote, arXiv
2507.04782, names head/neuron ablation among its methods; the layers, metric and ablation value here are
[ours]). A head is ablated at every position through ``blocks.{i}.attn.hook_z``, which exists for our GPT and,
through :mod:`reprlab.hooks.sites`, for Hugging Face GPT-2 and Llama-style models (the input of the attention
output projection, viewed per head), so the same call runs on all three.

Mean ablation replaces the head's output by its per-position mean over a reference set (the usual choice for
circuits: it removes the information the head carries about the item, not its average contribution); zero
ablation (``means=None``) removes the head altogether.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from reprlab.hooks import hooks, n_layers, run_with_cache

MetricFn = Callable[[Tensor, slice], Tensor]  # (logits, rows) -> per-item metric, see attribution.ItemMetric


def _logits(out) -> Tensor:
    return out if isinstance(out, Tensor) else out.logits


@torch.no_grad()
def head_means(model: nn.Module, ids: Tensor) -> dict[str, Tensor]:
    """Per-position mean of every ``hook_z`` over ``ids``: name -> (pos, n_heads, d_head)."""
    names = [f"blocks.{i}.attn.hook_z" for i in range(n_layers(model))]
    device = next(model.parameters()).device
    _, cache = run_with_cache(model, ids.to(device), names=names)
    return {k: v.mean(0) for k, v in cache.items()}


@dataclass(frozen=True)
class HeadAblationResult:
    """Mean metric without ablation (``base``) and ``effect[layer, head]`` = ablated mean metric − base."""

    base: float
    effect: Tensor  # (n_layers, n_heads)

    def to_json(self) -> dict:
        return {"base": self.base, "effect": self.effect.round(decimals=5).tolist()}


def _ablate(head: int, value: Tensor | None):
    def fn(z: Tensor, _name: str) -> Tensor:
        out = z.clone()
        out[:, :, head] = 0.0 if value is None else value[: z.shape[1], head].to(z.device, z.dtype)
        return out

    return fn


@torch.no_grad()
def head_ablation(model: nn.Module, ids: Tensor, metric: MetricFn,
                  means: dict[str, Tensor] | None = None) -> HeadAblationResult:  # fmt: skip
    """Ablate each head of each layer in turn (at every position) and record the metric change.

    Args:
        ids: (batch, pos) inputs.
        metric: maps logits and a row slice to a per-item metric (:class:`reprlab.interp.attribution.ItemMetric`).
        means: :func:`head_means` of a reference set for mean ablation; ``None`` ablates to zero.
    """
    device = next(model.parameters()).device
    x = ids.to(device)
    rows = slice(0, x.shape[0])
    name0 = "blocks.0.attn.hook_z"
    out, cache = run_with_cache(model, x, names=[name0])
    base = metric(_logits(out), rows).mean().item()
    n_heads = cache[name0].shape[2]
    effect = torch.zeros(n_layers(model), n_heads)
    for layer in range(n_layers(model)):
        name = f"blocks.{layer}.attn.hook_z"
        for h in range(n_heads):
            with hooks(model, [(name, _ablate(h, None if means is None else means[name]))]):
                effect[layer, h] = metric(_logits(model(x)), rows).mean().item() - base
    return HeadAblationResult(base, effect)


__all__ = ["HeadAblationResult", "head_ablation", "head_means"]
