"""Edge attribution patching against finite-difference edge patching, and edge-ablation invariants."""

import pytest
import torch

from reprlab.interp.attribution import ItemMetric
from reprlab.interp.edges import (
    _input_hooks,
    _outputs,
    edge_attribution_patching,
    edge_faithfulness,
    graph,
    run_with_edges,
    upstream_means,
)
from reprlab.models.gpt import GPT, GPTConfig


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    return GPT(
        GPTConfig(d_vocab=13, n_ctx=10, n_layers=2, d_model=32, n_heads=4, d_mlp=64, init_std=0.2)
    ).eval()


def _data(n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    clean, corrupt = torch.randint(0, 13, (n, 10), generator=g), torch.randint(0, 13, (n, 10), generator=g)
    metric = ItemMetric(torch.randint(3, 10, (n,), generator=g), torch.randint(0, 13, (n,), generator=g),
                        torch.randint(0, 13, (n,), generator=g))  # fmt: skip
    return clean, corrupt, metric


def test_graph_edges_respect_forward_order(gpt):
    ups, downs, edges = graph(gpt)
    assert len(ups) == 1 + 2 * (4 + 1) and downs == ["a0", "m0", "a1", "m1", "logits"]
    # counted by hand: a0 <- embed (1); m0 <- embed + 4 heads (5); a1 <- 6; m1 <- 10; logits <- 11
    assert len(edges) == 1 + 5 + 6 + 10 + 11
    assert ("a1.h0", "a1") not in edges and ("a0.h3", "m0") in edges and ("m1", "logits") in edges


@pytest.mark.parametrize("edge", [("embed", "a1"), ("a0.h2", "m0"), ("a0.h1", "a1"), ("m0", "logits")])
def test_eap_score_is_the_first_order_effect_of_patching_that_edge(gpt, edge):
    clean, corrupt, metric = _data()
    res = edge_attribution_patching(gpt, clean, corrupt, metric)
    u, v = edge
    with torch.no_grad():
        _, out_clean = _outputs(gpt, clean)
        _, out_corr = _outputs(gpt, corrupt)
        base = metric(gpt(clean), slice(0, 12)).mean().item()
    delta = out_corr[u] - out_clean[u]
    eps = 1e-3
    handles = _input_hooks(gpt, lambda name, x: x + eps * delta if name == v else x)
    try:
        with torch.no_grad():
            moved = metric(gpt(clean), slice(0, 12)).mean().item()
    finally:
        for h in handles:
            h.remove()
    # oracle: a finite difference of the actual edge patch (only v reads the change; the skip path does
    # not), scaled back by 1/eps; agreement to O(eps) and fp32 round-off
    assert res.scores[edge] == pytest.approx((moved - base) / eps, rel=2e-2, abs=2e-3)


def test_eap_ig_is_complete_on_the_embedding_edges(gpt):
    clean, corrupt, metric = _data(seed=1)
    plain = edge_attribution_patching(gpt, clean, corrupt, metric)
    ig = edge_attribution_patching(gpt, clean, corrupt, metric, ig_steps=64)
    assert ig.metric_clean == pytest.approx(plain.metric_clean, abs=1e-5)  # same clean metric either way
    # oracle: integrated-gradients completeness. Every reader of the residual stream is a downstream node,
    # so the embedding's edges together carry the whole path integral from clean to corrupted embeddings:
    # sum_v score(embed -> v) = m(corrupt) - m(clean), up to the midpoint rule's error at 64 steps
    total = sum(sc for (u, _), sc in ig.scores.items() if u == "embed")
    exact = ig.metric_corrupt - ig.metric_clean
    assert total == pytest.approx(exact, rel=2e-2, abs=1e-3)
    # the plain gradient is only first order: on this strongly non-linear model (init_std 0.2) it is off
    first_order = sum(sc for (u, _), sc in plain.scores.items() if u == "embed")
    assert abs(first_order - exact) > 10 * abs(total - exact)


def test_edge_ablation_invariants(gpt):
    clean, _, metric = _data(seed=2)
    means = upstream_means(gpt, clean)
    _, _, edges = graph(gpt)
    with torch.no_grad():
        full = gpt(clean)
    # keeping every edge ablates nothing: exactly the model
    torch.testing.assert_close(run_with_edges(gpt, clean, set(edges), means), full, atol=1e-5, rtol=1e-5)
    # ablating every edge leaves only means and biases: the same logits for every item at each position
    empty = run_with_edges(gpt, clean, None, means)
    torch.testing.assert_close(empty, empty[:1].expand_as(empty), atol=1e-5, rtol=1e-5)
    f = edge_faithfulness(gpt, clean, metric, set(edges), means)
    assert f.faithfulness == pytest.approx(1.0, abs=1e-4)
    assert edge_faithfulness(gpt, clean, metric, set(), means).faithfulness == pytest.approx(0.0, abs=1e-4)
