"""Node attribution patching, circuits as top-k node sets, IoU and mean-ablation faithfulness.

Attribution patching (Nanda 2023; the node form of EAP, Syed et al. 2023, arXiv 2310.10348) linearises
activation patching: for a node activation ``a`` and a metric ``m``,

    score(node) ≈ (a_corrupt - a_clean) · ∂m/∂a |_clean

from one clean forward + backward and one corrupted forward. [ours] Nodes are attention heads
(``blocks.{i}.attn.hook_z``, summed over d_head) and MLP neurons (``blocks.{i}.mlp.hook_post``), each at
each position, so a node is (component, position). Scores are averaged over items; a circuit is the
``top_k`` nodes by |mean score|. The paper builds *edge* circuits (EAP); we use nodes [ours] (node attribution
patching is the cheaper variant of the same method; it keeps the tiny-CPU budget), and
:mod:`reprlab.interp.edges` builds the edge circuits as an option.

Faithfulness = (m(circuit) - m(empty)) / (m(full) - m(empty)), where non-circuit nodes are mean-ablated
(replaced by their mean over a reference set, per position) and ``empty`` ablates every node.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from reprlab.hooks import hooks, n_layers, run_with_cache

MetricFn = Callable[[Tensor], Tensor]  # logits (batch, pos, d_vocab) -> per-item metric (batch,)


def node_hooks(model: nn.Module) -> list[str]:
    """Hook names whose coordinates are nodes: per-head z and MLP neurons of every block."""
    n = n_layers(model)
    return [f"blocks.{i}.attn.hook_z" for i in range(n)] + [f"blocks.{i}.mlp.hook_post" for i in range(n)]


def _reduce(prod: Tensor, name: str) -> Tensor:
    # hook_z products are summed over d_head so each head is one node
    return prod.sum(-1) if name.endswith("hook_z") else prod


@dataclass(frozen=True)
class AttributionResult:
    """Mean attribution scores per node.

    Attributes:
        scores: hook name -> (pos, n_units) mean score over items (units = heads or neurons).
        metric_clean, metric_corrupt: mean metric on the clean and corrupted inputs.
    """

    scores: dict[str, Tensor]
    metric_clean: float
    metric_corrupt: float

    def flat(self) -> tuple[Tensor, list[tuple[str, int, int]]]:
        """All scores as one vector and the matching (hook, position, unit) node ids."""
        vals, ids = [], []
        for name, s in self.scores.items():
            vals.append(s.flatten())
            ids += [(name, p, u) for p in range(s.shape[0]) for u in range(s.shape[1])]
        return torch.cat(vals), ids

    def top_k(self, k: int) -> set[tuple[str, int, int]]:
        """The ``k`` nodes with the largest |mean score|."""
        vals, ids = self.flat()
        idx = vals.abs().topk(min(k, len(ids))).indices.tolist()
        return {ids[i] for i in idx}


def attribution_patching(model: nn.Module, clean_ids: Tensor, corrupt_ids: Tensor, metric: MetricFn,
                         names: list[str] | None = None, batch_size: int = 256) -> AttributionResult:  # fmt: skip
    """Node attribution scores ``(a_corrupt - a_clean) · ∂m/∂a`` averaged over items.

    Args:
        clean_ids, corrupt_ids: (batch, pos) paired inputs of equal shape.
        metric: maps logits of a sub-batch to a per-item metric; it is called with the rows in order, so it
            may close over per-item data indexed by a running offset (see :class:`ItemMetric`).
    """
    names = names or node_hooks(model)
    device = next(model.parameters()).device
    sums: dict[str, Tensor] = {}
    m_clean, m_corrupt, n = 0.0, 0.0, clean_ids.shape[0]
    for s in range(0, n, batch_size):
        sl = slice(s, s + batch_size)
        with torch.no_grad():
            out_c, corrupt = run_with_cache(model, corrupt_ids[sl].to(device), names=names)
        model.zero_grad(set_to_none=True)
        with torch.enable_grad():
            logits, cache = run_with_cache(model, clean_ids[sl].to(device), names=names, detach=False)
            m = metric(logits, sl)
            m.sum().backward()
        with torch.no_grad():
            m_corrupt += metric(out_c, sl).sum().item()
        m_clean += m.sum().item()
        for name in names:
            prod = _reduce((corrupt[name] - cache[name].detach()) * cache[name].grad, name).sum(0)
            sums[name] = sums.get(name, 0) + prod.cpu()
    model.zero_grad(set_to_none=True)
    return AttributionResult({k: v / n for k, v in sums.items()}, m_clean / n, m_corrupt / n)


class ItemMetric:
    """``m = logit(target) - logit(alternative)`` at one position per item (our patching metric [ours]).

    Args:
        positions: (n,) position whose logits predict the answer token of interest.
        target, alternative: (n,) token ids (e.g. the noisy label ỹ_k and the true y*_k).
    """

    def __init__(self, positions: Tensor, target: Tensor, alternative: Tensor):
        self.positions, self.target, self.alternative = positions, target, alternative

    def __call__(self, logits: Tensor, sl: slice) -> Tensor:
        p = self.positions[sl].to(logits.device)
        rows = torch.arange(logits.shape[0], device=logits.device)
        at = logits[rows, p]  # (b, d_vocab)
        return at[rows, self.target[sl].to(logits.device)] - at[rows, self.alternative[sl].to(logits.device)]


@torch.no_grad()
def node_means(model: nn.Module, ids: Tensor, names: list[str] | None = None) -> dict[str, Tensor]:
    """Mean activation per hook over a reference set: name -> (pos, ...) (used for mean ablation)."""
    names = names or node_hooks(model)
    device = next(model.parameters()).device
    _, cache = run_with_cache(model, ids.to(device), names=names)
    return {k: v.mean(0) for k, v in cache.items()}


def _ablation_hooks(means: dict[str, Tensor], keep: set[tuple[str, int, int]] | None):
    """Hooks mean-ablating every node not in ``keep`` (all nodes when keep is None)."""

    def make(name: str):
        mean = means[name]

        def fn(act: Tensor, _n: str) -> Tensor:
            mask = torch.zeros(act.shape[1:3], dtype=torch.bool, device=act.device)  # (pos, units) kept
            if keep:
                for h, p, u in keep:
                    if h == name and p < act.shape[1]:
                        mask[p, u] = True
            m = mask if act.ndim == 3 else mask[..., None]
            return torch.where(m, act, mean[: act.shape[1]].to(act.device, act.dtype).expand_as(act))

        return fn

    return [(name, make(name)) for name in means]


@dataclass(frozen=True)
class FaithfulnessResult:
    """Mean metric with the circuit kept (others mean-ablated), all ablated, and nothing ablated."""

    m_circuit: float
    m_empty: float
    m_full: float

    @property
    def faithfulness(self) -> float:
        denom = self.m_full - self.m_empty
        return float("nan") if abs(denom) < 1e-9 else (self.m_circuit - self.m_empty) / denom


@torch.no_grad()
def faithfulness(model: nn.Module, ids: Tensor, metric: MetricFn, circuit: set[tuple[str, int, int]],
                 means: dict[str, Tensor]) -> FaithfulnessResult:  # fmt: skip
    """Mean-ablation faithfulness of ``circuit`` on ``ids`` (see module docstring)."""
    device = next(model.parameters()).device
    x = ids.to(device)
    sl = slice(0, x.shape[0])
    full = metric(model(x), sl).mean().item()
    with hooks(model, _ablation_hooks(means, None)):
        empty = metric(model(x), sl).mean().item()
    with hooks(model, _ablation_hooks(means, circuit)):
        circ = metric(model(x), sl).mean().item()
    return FaithfulnessResult(circ, empty, full)


def iou(a: set, b: set) -> float:
    """|a ∩ b| / |a ∪ b| (1.0 for two empty sets)."""
    return 1.0 if not (a or b) else len(a & b) / len(a | b)


def random_iou_baseline(n_nodes: int, k: int) -> float:
    """Expected IoU of two independent uniformly random k-subsets of n nodes: E|∩| = k²/n."""
    inter = k * k / n_nodes
    return float(inter / (2 * k - inter)) if k else 1.0


__all__ = [
    "AttributionResult", "FaithfulnessResult", "ItemMetric", "attribution_patching", "faithfulness", "iou",
    "node_hooks", "node_means", "random_iou_baseline",
]  # fmt: skip
