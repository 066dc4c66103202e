"""Edge attribution patching (EAP, optionally with integrated gradients) and edge-circuit faithfulness.

Reason to Rote (arXiv 2507.04782) builds *edge* circuits with EAP (Syed et al. 2023, arXiv 2310.10348);
they sit next to our node circuits (:mod:`reprlab.interp.attribution`). For an edge u -> v,

    score(u -> v) ≈ (out_u(corrupt) − out_u(clean)) · ∂m/∂(input of v) |_clean

summed over positions and averaged over items: one clean forward + backward and one corrupted forward. With
``ig_steps > 0`` the gradient is averaged over ``ig_steps`` points on the straight line from the clean to the
corrupted embeddings (EAP-IG, Hanna et al. 2024, arXiv 2403.17806), which is less sensitive to saturation.

Graph [ours; for our GPT and, through :mod:`reprlab.hooks.sites`, GPT-2 and Llama-style HF models]:

* upstream nodes u: ``embed``; each attention head ``a{i}.h{h}`` (its output ``z_h W_O_h`` in the residual
  stream; the output bias belongs to no head and is the same on both runs); each MLP ``m{i}``;
* downstream nodes v: the attention layer ``a{j}`` as a whole (the input of its norm: we do not split
  q/k/v inputs per head), the MLP ``m{j}``, and ``logits`` (the input of the final norm);
* u -> v exists when u is computed before v reads the residual stream.

Faithfulness of an edge circuit: every edge not in the circuit is *mean-ablated*: v reads its input with
``out_u`` replaced by ``mean(out_u)`` (per position, over a reference set) for each non-circuit edge u -> v,
and the metric is compared as for nodes: (m(circuit) − m(empty)) / (m(full) − m(empty)).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from reprlab.hooks import (
    block_norms,
    final_norm_and_unembed,
    head_out_weight,
    hooks,
    n_heads,
    n_layers,
)
from reprlab.interp.attribution import FaithfulnessResult

MetricFn = Callable[[Tensor, slice], Tensor]  # (logits, rows) -> per-item metric
Edge = tuple[str, str]


def graph(model: nn.Module) -> tuple[list[str], list[str], list[Edge]]:
    """(upstream nodes, downstream nodes, edges) of our GPT or a HF causal LM, in forward order."""
    n, h = n_layers(model), n_heads(model)
    ups, downs, edges = ["embed"], [], []
    for i in range(n):
        downs.append(f"a{i}")
        edges += [(u, f"a{i}") for u in ups]
        ups += [f"a{i}.h{k}" for k in range(h)]
        downs.append(f"m{i}")
        edges += [(u, f"m{i}") for u in ups]
        ups.append(f"m{i}")
    downs.append("logits")
    edges += [(u, "logits") for u in ups]
    return ups, downs, edges


def _ln(model: nn.Module, v: str) -> nn.Module:
    """The norm whose input is what downstream node ``v`` reads from the residual stream."""
    if v == "logits":
        return final_norm_and_unembed(model)[0]
    return block_norms(model, int(v[1:]))[0 if v[0] == "a" else 1]


class _Recorder:
    """Hooks recording every upstream node's residual-stream output during one forward pass.

    ``embed`` is the input of block 0 (``blocks.0.hook_resid_pre``); head ``k`` of block ``i`` writes
    ``z_k W_O[:, k]^T`` (``attn.hook_z`` times :func:`~reprlab.hooks.sites.head_out_weight`); MLP ``i`` writes
    ``mlp.hook_out``. ``embed``, if given, replaces the input of block 0 (EAP-IG's interpolated embeddings).
    """

    def __init__(self, model: nn.Module, embed: Tensor | None = None):
        self.out: dict[str, Tensor] = {}
        n = n_layers(model)
        weights = [head_out_weight(model, i) for i in range(n)]  # (d_model, heads, d_head) each

        def on_embed(x: Tensor, _name: str) -> Tensor | None:
            self.out["embed"] = x
            return embed

        def on_z(z: Tensor, name: str) -> None:  # z: (batch, pos, heads, d_head)
            i = int(name.split(".")[1])
            per_head = torch.einsum("bphd,mhd->bphm", z, weights[i])
            for k in range(per_head.shape[2]):
                self.out[f"a{i}.h{k}"] = per_head[:, :, k]

        def on_mlp(y: Tensor, name: str) -> None:
            self.out[f"m{name.split('.')[1]}"] = y

        fns = [("blocks.0.hook_resid_pre", on_embed)]
        for i in range(n):
            fns += [(f"blocks.{i}.attn.hook_z", on_z), (f"blocks.{i}.mlp.hook_out", on_mlp)]
        self._ctx = hooks(model, fns)
        self._ctx.__enter__()

    def remove(self) -> None:
        self._ctx.__exit__(None, None, None)


def _input_hooks(model: nn.Module, fn: Callable[[str, Tensor], Tensor]) -> list:
    """Forward pre-hooks on the norm that reads each downstream node's input: ``x -> fn(v, x)``."""
    handles = []
    for v in graph(model)[1]:

        def pre(_m, args, v=v):
            return (fn(v, args[0]), *args[1:])

        handles.append(_ln(model, v).register_forward_pre_hook(pre))
    return handles


@dataclass(frozen=True)
class EdgeAttribution:
    """Mean edge scores and the metric on both runs."""

    scores: dict[Edge, float]
    metric_clean: float
    metric_corrupt: float

    def top_k(self, k: int) -> set[Edge]:
        """The ``k`` edges with the largest |score|."""
        ranked = sorted(self.scores, key=lambda e: -abs(self.scores[e]))
        return set(ranked[:k])


def _outputs(model: nn.Module, ids: Tensor, embed: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    rec = _Recorder(model, embed)
    try:
        logits = model(ids)
    finally:
        rec.remove()
    return logits, rec.out


def edge_attribution_patching(model: nn.Module, clean_ids: Tensor, corrupt_ids: Tensor, metric: MetricFn,
                              ig_steps: int = 0, batch_size: int = 256) -> EdgeAttribution:  # fmt: skip
    """EAP (``ig_steps=0``) or EAP-IG edge scores, averaged over items (see the module docstring).

    Args:
        clean_ids, corrupt_ids: (batch, pos) paired inputs.
        metric: per-item metric of the logits (called with the row slice of the sub-batch).
        ig_steps: number of interpolation points for integrated gradients (0 = plain EAP gradient).
    """
    _, _, edges = graph(model)
    device = next(model.parameters()).device
    totals = dict.fromkeys(edges, 0.0)
    m_clean = m_corrupt = 0.0
    n = clean_ids.shape[0]
    for s in range(0, n, batch_size):
        sl = slice(s, s + batch_size)
        x_clean, x_corr = clean_ids[sl].to(device), corrupt_ids[sl].to(device)
        with torch.no_grad():
            logits_c, out_corr = _outputs(model, x_corr)
            _, out_clean = _outputs(model, x_clean)
            m_corrupt += metric(logits_c, sl).sum().item()
        alphas = [0.0] if ig_steps <= 0 else [(k + 0.5) / ig_steps for k in range(ig_steps)]
        grads: dict[str, Tensor] = {}
        for alpha in alphas:
            inputs: dict[str, Tensor] = {}

            def grab(v: str, x: Tensor, inputs=inputs) -> Tensor:
                x = x.clone()
                x.retain_grad()
                inputs[v] = x
                return x

            embed = None
            if ig_steps > 0:
                # a leaf that requires grad, so every downstream input (also a0's, = the embedding) has a grad
                embed = (
                    out_clean["embed"] + alpha * (out_corr["embed"] - out_clean["embed"])
                ).requires_grad_(True)
            handles = _input_hooks(model, grab)
            try:
                model.zero_grad(set_to_none=True)
                with torch.enable_grad():
                    logits, _ = _outputs(model, x_clean, embed)
                    m = metric(logits, sl)
                    m.sum().backward()
            finally:
                for h in handles:
                    h.remove()
            if alpha == alphas[0] and ig_steps <= 0:
                m_clean += m.sum().item()
            for v, x in inputs.items():
                grads[v] = grads.get(v, 0) + x.grad.detach() / len(alphas)
        if ig_steps > 0:
            with torch.no_grad():
                m_clean += metric(model(x_clean), sl).sum().item()
        for u, v in edges:
            totals[(u, v)] += ((out_corr[u] - out_clean[u]) * grads[v]).sum().item()
    model.zero_grad(set_to_none=True)
    return EdgeAttribution({e: t / n for e, t in totals.items()}, m_clean / n, m_corrupt / n)


@torch.no_grad()
def upstream_means(model: nn.Module, ids: Tensor) -> dict[str, Tensor]:
    """Per-position mean residual-stream output of every upstream node over ``ids``: (pos, d_model) each."""
    _, out = _outputs(model, ids.to(next(model.parameters()).device))
    return {u: o.mean(0) for u, o in out.items()}


@torch.no_grad()
def run_with_edges(model: nn.Module, ids: Tensor, keep: set[Edge] | None, means: dict[str, Tensor]) -> Tensor:
    """Logits with every edge outside ``keep`` mean-ablated (``keep=None``: every edge ablated)."""
    _, _, edges = graph(model)
    into: dict[str, list[str]] = {}
    for u, v in edges:
        if keep is None or (u, v) not in keep:
            into.setdefault(v, []).append(u)
    rec = _Recorder(model)

    def correct(v: str, x: Tensor) -> Tensor:
        for u in into.get(v, []):
            x = x + (means[u][: x.shape[1]] - rec.out[u])
        return x

    handles = _input_hooks(model, correct)
    try:
        return model(ids.to(next(model.parameters()).device))
    finally:
        rec.remove()
        for h in handles:
            h.remove()


# The circuit-kept / all-ablated / none-ablated triple is the node analysis's; an edge circuit reads the same.
EdgeFaithfulness = FaithfulnessResult


@torch.no_grad()
def edge_faithfulness(model: nn.Module, ids: Tensor, metric: MetricFn, circuit: set[Edge],
                      means: dict[str, Tensor]) -> EdgeFaithfulness:  # fmt: skip
    """Faithfulness of an edge circuit under mean ablation of the other edges (module docstring)."""
    sl = slice(0, ids.shape[0])
    full = metric(model(ids.to(next(model.parameters()).device)), sl).mean().item()
    empty = metric(run_with_edges(model, ids, None, means), sl).mean().item()
    circ = metric(run_with_edges(model, ids, circuit, means), sl).mean().item()
    return EdgeFaithfulness(circ, empty, full)


__all__ = [
    "EdgeAttribution", "EdgeFaithfulness", "edge_attribution_patching", "edge_faithfulness", "graph",
    "run_with_edges", "upstream_means",
]  # fmt: skip
