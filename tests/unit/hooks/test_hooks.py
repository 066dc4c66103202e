"""Hook names, cache and patching on our GPT and on a HF GPT-2 with the same weights."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from reprlab.hooks import hooks, patch, patch_positions, run_with_cache
from reprlab.models.gpt import from_hf_gpt2

SHARED = [
    "blocks.0.hook_resid_pre",
    "blocks.1.hook_resid_post",
    "blocks.0.mlp.hook_post",
    "blocks.1.attn.hook_out",
    "blocks.0.mlp.hook_out",
]


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=19,
        n_positions=12,
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_inner=64,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    hf = GPT2LMHeadModel(cfg).eval()
    return from_hf_gpt2(hf).eval(), hf


def test_cache_matches_between_ours_and_hf(pair):
    ours, hf = pair
    ids = torch.randint(0, 19, (3, 12))
    _, c1 = run_with_cache(ours, ids, names=SHARED)
    _, c2 = run_with_cache(hf, ids, names=SHARED)
    for name in SHARED:  # same weights -> same activations; 1e-5 for float32 op-order differences
        torch.testing.assert_close(c1[name], c2[name], atol=1e-5, rtol=0)
    assert c1["blocks.0.mlp.hook_post"].shape == (3, 12, 64)


def test_resid_mid_identity(pair):
    ours, _ = pair
    ids = torch.randint(0, 19, (2, 12))
    names = [
        "blocks.1.hook_resid_pre",
        "blocks.1.attn.hook_out",
        "blocks.1.hook_resid_mid",
        "blocks.1.mlp.hook_out",
        "blocks.1.hook_resid_post",
    ]
    _, c = run_with_cache(ours, ids, names=names)
    # residual bookkeeping: mid = pre + attn_out, post = mid + mlp_out
    torch.testing.assert_close(c[names[2]], c[names[0]] + c[names[1]])
    torch.testing.assert_close(c[names[4]], c[names[2]] + c[names[3]])


@pytest.mark.parametrize("which", [0, 1])
def test_full_residual_patch_reproduces_source(pair, which):
    model = pair[which]
    src, tgt = torch.randint(0, 19, (2, 12)), torch.randint(0, 19, (2, 12))
    name = "blocks.1.hook_resid_pre"
    src_logits, cache = run_with_cache(model, src, names=[name])
    src_logits = src_logits if which == 0 else src_logits.logits
    with torch.no_grad(), patch(model, {name: cache[name]}):
        out = model(tgt)
    out = out if which == 0 else out.logits
    # patching the whole residual into block 1 makes everything downstream the source run's
    torch.testing.assert_close(out, src_logits, atol=1e-5, rtol=0)


def test_position_patch_is_causal_and_changes_output(pair):
    ours, _ = pair
    src, tgt = torch.randint(0, 19, (2, 12)), torch.randint(0, 19, (2, 12))
    name = "blocks.0.hook_resid_post"
    _, cache = run_with_cache(ours, src, names=[name])
    with torch.no_grad():
        clean = ours(tgt)
        with patch(ours, {name: patch_positions(cache[name], positions=[6])}):
            patched = ours(tgt)
    torch.testing.assert_close(patched[:, :6], clean[:, :6])  # earlier positions cannot see position 6
    assert (patched[:, 6:] - clean[:, 6:]).abs().max() > 1e-4  # the patch did something (nnsight pitfall)
    with torch.no_grad():  # hooks are gone after the context
        torch.testing.assert_close(ours(tgt), clean)


def test_neuron_index_patch(pair):
    ours, _ = pair
    ids = torch.randint(0, 19, (2, 12))
    name = "blocks.0.mlp.hook_post"
    seen = {}
    zero = torch.zeros(2, 12, 64)
    with hooks(
        ours,
        [
            (name, patch_positions(zero, positions=[3], index=[5, 7])),
            ("blocks.0.mlp.hook_post", lambda a, n: seen.setdefault(n, a.clone())),
        ],
    ):
        ours(ids)
    act = seen[name]
    assert act[:, 3, [5, 7]].abs().max() == 0
    assert act[:, 3, 6].abs().max() > 0 and act[:, 2, 5].abs().max() > 0


def test_unknown_hook_names(pair):
    ours, hf = pair
    with pytest.raises(KeyError, match="valid hooks"):
        run_with_cache(ours, torch.zeros(1, 3, dtype=torch.long), names=["blocks.9.hook_resid_post"])
    with pytest.raises(KeyError, match="hook_resid_pre"):
        run_with_cache(hf, torch.zeros(1, 3, dtype=torch.long), names=["blocks.0.hook_resid_mid"])


def test_gradients_through_cache(pair):
    ours, _ = pair
    ids = torch.randint(0, 19, (2, 12))
    logits, cache = run_with_cache(ours, ids, names=["blocks.0.mlp.hook_post"], detach=False)
    logits[:, -1, 3].sum().backward()
    g = cache["blocks.0.mlp.hook_post"].grad
    assert g is not None and torch.isfinite(g).all() and g.abs().max() > 0
    ours.zero_grad(set_to_none=True)
