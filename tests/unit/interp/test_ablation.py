"""Head ablation through ``hook_z`` on our GPT, HF GPT-2 and a tiny Llama, against independent oracles."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from reprlab.hooks import run_with_cache
from reprlab.interp.ablation import head_ablation, head_means
from reprlab.interp.attribution import ItemMetric
from reprlab.models.gpt import GPT, GPTConfig, from_hf_gpt2


def _metric(n: int, seed: int = 0) -> ItemMetric:
    g = torch.Generator().manual_seed(seed)
    return ItemMetric(torch.randint(0, 10, (n,), generator=g), torch.randint(0, 13, (n,), generator=g),
                      torch.randint(0, 13, (n,), generator=g))  # fmt: skip


@pytest.fixture(scope="module")
def gpt2_pair():
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=13, n_positions=10, n_embd=32, n_layer=2, n_head=4, n_inner=64,
                     tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)  # fmt: skip
    hf = GPT2LMHeadModel(cfg).eval()
    return hf, from_hf_gpt2(hf).eval()


def test_hf_hook_z_is_our_hook_z(gpt2_pair):
    hf, ours = gpt2_pair
    ids = torch.randint(0, 13, (4, 10))
    _, a = run_with_cache(hf, ids, names=["blocks.1.attn.hook_z"])
    _, b = run_with_cache(ours, ids, names=["blocks.1.attn.hook_z"])
    assert a["blocks.1.attn.hook_z"].shape == (4, 10, 4, 8)
    # oracle: the same weights in two implementations (HF's fused c_attn vs our GPT); fp32 round-off
    torch.testing.assert_close(a["blocks.1.attn.hook_z"], b["blocks.1.attn.hook_z"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mean", [False, True])
def test_head_ablation_agrees_between_hf_gpt2_and_our_gpt(gpt2_pair, mean):
    hf, ours = gpt2_pair
    ids = torch.randint(0, 13, (16, 10))
    means = (head_means(hf, ids), head_means(ours, ids)) if mean else (None, None)
    a = head_ablation(hf, ids, _metric(16), means[0])
    b = head_ablation(ours, ids, _metric(16), means[1])
    assert a.effect.shape == (2, 4)
    assert a.effect.abs().max() > 1e-3  # ablating heads of a random model moves the metric at all
    torch.testing.assert_close(
        a.effect, b.effect, atol=1e-4, rtol=1e-4
    )  # fp32 round-off across implementations
    assert a.base == pytest.approx(b.base, abs=1e-5)


def test_zero_ablating_a_head_equals_zeroing_its_output_projection():
    torch.manual_seed(1)
    model = GPT(GPTConfig(d_vocab=13, n_ctx=10, n_layers=2, d_model=32, n_heads=4, d_mlp=64)).eval()
    ids = torch.randint(0, 13, (8, 10))
    metric = _metric(8, seed=2)
    res = head_ablation(model, ids, metric)
    # oracle: zero-ablating head 2 of block 1 = removing its 8 input columns of the output projection
    edited = GPT(model.cfg).eval()
    edited.load_state_dict(model.state_dict())
    with torch.no_grad():
        edited.blocks[1].attn.proj.weight[:, 16:24] = 0.0
        expected = metric(edited(ids), slice(0, 8)).mean().item() - res.base
    assert res.effect[1, 2].item() == pytest.approx(expected, abs=1e-5)


def test_head_ablation_runs_on_llama_hook_z():
    from reprlab.models.hf import tiny_llama

    llama = tiny_llama(seed=0, vocab_size=13)[0].eval()
    ids = torch.randint(0, 13, (4, 10))
    res = head_ablation(llama, ids, _metric(4))
    heads = llama.config.num_attention_heads
    assert res.effect.shape == (llama.config.num_hidden_layers, heads)
    # oracle: zero-ablating head 0 of layer 0 = zeroing its columns of o_proj
    d_head = llama.config.hidden_size // heads
    w = llama.model.layers[0].self_attn.o_proj.weight
    saved = w.detach().clone()
    with torch.no_grad():
        w[:, :d_head] = 0.0
        expected = _metric(4)(llama(ids).logits, slice(0, 4)).mean().item() - res.base
        w.copy_(saved)
    assert res.effect[0, 0].item() == pytest.approx(expected, abs=1e-5)
