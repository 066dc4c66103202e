"""Logit lens, probes, INLP, attribution patching and neuron statistics against invariants and oracles."""

import numpy as np
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from reprlab.hooks import run_with_cache
from reprlab.interp.attribution import (
    ItemMetric,
    attribution_patching,
    faithfulness,
    iou,
    node_hooks,
    node_means,
    random_iou_baseline,
)
from reprlab.interp.inlp import inlp, project_out_hook, random_projection
from reprlab.interp.logit_lens import logit_lens
from reprlab.interp.neurons import conditional_stats, patch_to_conditional_mean
from reprlab.interp.probing import collect, probe_grid
from reprlab.models.gpt import GPT, GPTConfig


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(d_vocab=13, n_ctx=10, n_layers=2, d_model=32, n_heads=4, d_mlp=64)).eval()


@pytest.fixture(scope="module")
def hf_gpt2():
    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=13,
        n_positions=10,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_inner=64,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg).eval()


@pytest.fixture(scope="module")
def llama():
    from reprlab.models.hf import tiny_llama

    return tiny_llama(seed=0, vocab_size=13)[0]


@pytest.mark.parametrize("which", ["gpt", "hf_gpt2", "llama"])
def test_logit_lens_last_layer_equals_model_output(which, request):
    model = request.getfixturevalue(which)
    ids = torch.randint(0, 13, (5, 10))
    pos, ta, tb = torch.tensor([3, 9, 0, 5, 7]), torch.randint(0, 13, (5,)), torch.randint(0, 13, (5,))
    res = logit_lens(model, ids, pos, ta, tb)
    with torch.no_grad():
        out = model(ids)
        logits = out if isinstance(out, torch.Tensor) else out.logits
    probs = logits.softmax(-1)[torch.arange(5), pos]
    # the lens at the last layer is exactly the model's output distribution (oracle: the model itself)
    np.testing.assert_allclose(res.prob_a[-1], probs[torch.arange(5), ta].numpy(), atol=1e-6)
    # the lens and the forward are two paths (logits agree to ~1e-6): a rank may differ only where another
    # logit is within 1e-5 of b's, so the rank must lie between the counts with that slack
    row, lb = logits[torch.arange(5), pos], logits[torch.arange(5), pos, tb][:, None]
    lo, hi = (row > lb + 1e-5).sum(-1).numpy(), (row > lb - 1e-5).sum(-1).numpy() - 1  # b is not above itself
    assert ((lo <= res.rank_b[-1]) & (res.rank_b[-1] <= hi)).all() and (lo == hi).sum() >= 4  # ties are rare
    assert res.prob_a.shape == (3, 5) and len(res.layers) == 3


def test_probe_grid_planted_signal():
    rng = np.random.default_rng(0)
    n, d = 400, 8
    x = torch.tensor(rng.normal(size=(2, n, 3, d)), dtype=torch.float32)
    y = rng.integers(0, 2, n)
    x[1, :, 2, 0] += torch.tensor(
        4.0 * (2 * y - 1), dtype=torch.float32
    )  # signal only at layer 1, position 2
    res = probe_grid("y", x[:, :300], y[:300], {"test": (x[:, 300:], y[300:])}, ["l0", "l1"], [0, 1, 2])
    assert res.best == (1, 2)
    assert res.acc["test"][1, 2] > 0.95  # separable with margin 4 sigma
    assert res.acc["test"][0].max() < 0.7 and res.acc_shuffled[1, 2] < 0.7  # no signal / shuffled ~ chance


def test_collect_shapes_hf(hf_gpt2, llama):
    acts = collect(hf_gpt2, torch.randint(0, 13, (4, 10)), ["blocks.0.hook_resid_post"], [2, 5])
    assert acts.shape == (1, 4, 2, 32)
    # Llama's gated MLP: hook_post is the input of down_proj, act(gate) * up, one value per neuron
    acts = collect(
        llama, torch.randint(0, 13, (4, 10)), ["blocks.1.mlp.hook_post", "blocks.0.hook_resid_pre"][:1], [2]
    )
    assert acts.shape == (1, 4, 1, 64)


def test_inlp_removes_planted_concept():
    rng = np.random.default_rng(0)
    n, d = 600, 16
    x = rng.normal(size=(n, d))
    y = rng.integers(0, 2, n)
    x[:, :2] += 3.0 * (2 * y[:, None] - 1)  # concept spread over two coordinates
    res = inlp(x, y, n_iters=6, seed=0)
    p = res.projection.double()
    assert res.accuracies[0] > 0.95 and res.converged
    assert res.accuracies[-1] <= res.majority + 0.02 + 1e-9
    torch.testing.assert_close(p @ p, p, atol=1e-5, rtol=0)  # orthogonal projection: idempotent, symmetric
    torch.testing.assert_close(p, p.T)
    torch.testing.assert_close(res.basis.T @ res.basis, torch.eye(res.rank), atol=1e-5, rtol=0)
    r = random_projection(d, res.rank, seed=1)
    assert torch.trace(r).item() == pytest.approx(d - res.rank, abs=1e-4)  # trace of a projection = its rank


def test_project_out_hook_positions():
    act = torch.randn(2, 5, 4)
    p = random_projection(4, 1, seed=0)
    out = project_out_hook(p, [3])(act, "x")
    torch.testing.assert_close(out[:, 3], act[:, 3] @ p)
    torch.testing.assert_close(out[:, :3], act[:, :3])


def test_attribution_matches_activation_patching(gpt):
    """First-order oracle: on a near-linear random model, AP scores track real single-node patching."""
    torch.manual_seed(1)
    clean, corrupt = torch.randint(0, 13, (8, 10)), torch.randint(0, 13, (8, 10))
    metric = ItemMetric(torch.full((8,), 9), torch.full((8,), 1), torch.full((8,), 2))
    res = attribution_patching(gpt, clean, corrupt, metric, names=["blocks.1.mlp.hook_post"])
    _, c_cache = run_with_cache(gpt, corrupt, names=["blocks.1.mlp.hook_post"])
    base = metric(gpt(clean), slice(0, 8)).mean().item()
    scores, actual = [], []
    for u in range(0, 64, 4):  # 16 neurons at the metric position

        def fn(a, _n, u=u):
            a = a.clone()
            a[:, 9, u] = c_cache["blocks.1.mlp.hook_post"][:, 9, u]
            return a

        from reprlab.hooks import hooks

        with torch.no_grad(), hooks(gpt, [("blocks.1.mlp.hook_post", fn)]):
            actual.append(metric(gpt(clean), slice(0, 8)).mean().item() - base)
        scores.append(res.scores["blocks.1.mlp.hook_post"][9, u].item())
    assert np.corrcoef(scores, actual)[0, 1] > 0.95  # linearisation error is second order here


def test_faithfulness_bounds_and_iou(gpt):
    ids = torch.randint(0, 13, (6, 10))
    metric = ItemMetric(torch.full((6,), 9), torch.full((6,), 1), torch.full((6,), 2))
    means = node_means(gpt, torch.randint(0, 13, (32, 10)))
    everything = {
        (n, p, u)
        for n in node_hooks(gpt)
        for p in range(10)
        for u in range(4 if n.endswith("hook_z") else 64)
    }
    full = faithfulness(gpt, ids, metric, everything, means)
    assert full.m_circuit == pytest.approx(full.m_full, abs=1e-5)  # keeping every node = no ablation
    empty = faithfulness(gpt, ids, metric, set(), means)
    assert empty.m_circuit == pytest.approx(empty.m_empty, abs=1e-6)
    assert iou({1, 2, 3}, {2, 3, 4}) == 0.5 and iou(set(), set()) == 1.0
    rng = np.random.default_rng(0)  # Monte-Carlo check of the closed-form random IoU (±0.01 at 2000 draws)
    sims = [
        iou(set(rng.choice(200, 20, replace=False)), set(rng.choice(200, 20, replace=False)))
        for _ in range(2000)
    ]
    assert random_iou_baseline(200, 20) == pytest.approx(np.mean(sims), abs=0.01)


def test_conditional_stats_and_patch():
    acts = torch.randn(50, 2, 3)
    feats = torch.randint(0, 4, (50, 2))
    st = conditional_stats(acts, feats, n_values=4)
    sel = acts[feats[:, 1] == 2, 1]
    torch.testing.assert_close(st.mean[1, 2], sel.mean(0))  # oracle: group mean
    mu, _ = st.lookup(feats)
    assert mu.shape == (50, 2, 3)
    out = patch_to_conditional_mean([4, 6], torch.tensor([0, 2]), mu[..., [0, 2]])(torch.zeros(50, 8, 3), "h")
    torch.testing.assert_close(out[:, 4, 0], mu[:, 0, 0])
    assert out[:, 4, 1].abs().max() == 0 and out[:, 5].abs().max() == 0


def test_inlp_max_rank_caps_multiclass_removal():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(500, 12))
    y = rng.integers(0, 6, 500)
    x[np.arange(500), y] += 3.0  # six classes, one direction each
    res = inlp(x, y, n_iters=5, max_rank=4, seed=0)
    assert res.rank == 4 and len(res.accuracies) >= 2
    assert (
        res.accuracies[-1] < res.accuracies[0]
    )  # removing 4 of the 6 class directions still hurts the probe
