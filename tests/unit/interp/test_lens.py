"""TransformerLens interop: our GPT -> HookedTransformer -> our GPT with equal logits and activations.

Tolerances: in float64 both implementations agree to ~1e-15 on O(1) logits, so 1e-10 leaves only rounding;
any wrong mapping (a transposed head, swapped Q/K, a dropped bias) moves logits by >= 1e-3 (checked below by
planting each bug). In float32 the two differ by op order only (fused qkv + SDPA vs per-head einsums):
measured <= 2e-6, bounded at 1e-5 as in the HF GPT-2 oracle test.
"""

import pytest
import torch

pytest.importorskip("transformer_lens")

from reprlab.hooks import run_with_cache  # noqa: E402
from reprlab.interp.lens import (  # noqa: E402
    from_hooked_transformer,
    gpt_to_tl_state_dict,
    tl_hook_name,
    to_hooked_transformer,
)
from reprlab.models.gpt import GPT, GPTConfig  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _gpt(dtype=torch.float64, act="gelu_tanh", seed=0) -> GPT:
    """Tiny random GPT with non-trivial LayerNorms and biases (defaults (1, 0) would hide mapping errors)."""
    torch.manual_seed(seed)
    m = GPT(GPTConfig(d_vocab=19, n_ctx=10, n_layers=2, d_model=24, n_heads=3, d_mlp=40, act=act))
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "ln" in name or "bias" in name:
                p.add_(0.2 * torch.randn_like(p))
            else:  # larger weights than the 0.02 init so attention patterns are not uniform
                p.mul_(10)
    return m.to(dtype).eval()


IDS = torch.randint(0, 19, (4, 10), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("act", ["gelu_tanh", "gelu"])
def test_logits_equal_after_conversion_and_back(act):
    ours = _gpt(act=act)
    ht = to_hooked_transformer(ours)
    with torch.no_grad():
        ref = ours(IDS)
        assert ref.std() > 0.1  # logits are O(1): the tolerance below is relative to real signal
        torch.testing.assert_close(ht(IDS), ref, atol=1e-10, rtol=0)
        back = from_hooked_transformer(ht)
        torch.testing.assert_close(back(IDS), ref, atol=1e-10, rtol=0)
    for k, v in ours.state_dict().items():  # the round trip is the identity on every parameter
        torch.testing.assert_close(back.state_dict()[k], v, atol=0, rtol=0)


def test_float32_logits_within_rounding():
    ours = _gpt(dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(to_hooked_transformer(ours)(IDS), ours(IDS), atol=1e-5, rtol=0)


def test_activations_equal_at_mapped_hook_names():
    ours = _gpt()
    ht = to_hooked_transformer(ours)
    names = ["hook_embed"] + [
        f"blocks.{i}.{s}"
        for i in range(2)
        for s in (
            "hook_resid_pre",
            "hook_resid_mid",
            "hook_resid_post",
            "attn.hook_z",
            "attn.hook_out",
            "mlp.hook_pre",
            "mlp.hook_post",
            "mlp.hook_out",
        )  # fmt: skip
    ]
    _, cache = run_with_cache(ours, IDS, names=names)
    _, tl_cache = ht.run_with_cache(IDS)
    for n in names:
        torch.testing.assert_close(tl_cache[tl_hook_name(n)], cache[n], atol=1e-10, rtol=0, msg=n)
    with pytest.raises(KeyError, match="no TransformerLens"):
        tl_hook_name("blocks.0.attn.hook_q")


def _swap_qk(sd):
    sd["blocks.1.attn.W_Q"], sd["blocks.1.attn.W_K"] = sd["blocks.1.attn.W_K"], sd["blocks.1.attn.W_Q"]


def _transpose_head_weights(sd):  # (in, out) <-> (out, in) inside each head: a square view of W_V
    w = sd["blocks.0.attn.W_V"]  # (nh, dm, dh) = (3, 24, 8)
    sd["blocks.0.attn.W_V"] = w.reshape(3, 8, 24).transpose(1, 2).contiguous()


def _wrong_head_order_in_w_o(sd):
    sd["blocks.0.attn.W_O"] = sd["blocks.0.attn.W_O"].flip(0)


def _w_in_without_transpose(sd):
    sd["blocks.1.mlp.W_in"] = sd["blocks.1.mlp.W_in"].T.reshape(24, 40)


def _ln_swapped(sd):
    sd["blocks.0.ln1.w"], sd["blocks.0.ln2.w"] = sd["blocks.0.ln2.w"], sd["blocks.0.ln1.w"]


@pytest.mark.parametrize(
    "bug", [_swap_qk, _transpose_head_weights, _wrong_head_order_in_w_o, _w_in_without_transpose, _ln_swapped]
)
def test_a_wrong_weight_mapping_is_detected(bug):
    """Plant each plausible mapping bug: logits must move far beyond the tolerance the tests use."""
    ours = _gpt()
    ht = to_hooked_transformer(ours)
    sd = {**ht.state_dict(), **gpt_to_tl_state_dict(ours)}
    bug(sd)
    ht.load_state_dict(sd)
    with torch.no_grad():
        assert (ht(IDS) - ours(IDS)).abs().max() > 1e-3


def test_unrepresentable_models_are_refused():
    ht = to_hooked_transformer(_gpt())
    with torch.no_grad():
        ht.unembed.b_U.fill_(0.1)
    with pytest.raises(ValueError, match="b_U"):
        from_hooked_transformer(ht)
    ht = to_hooked_transformer(_gpt())
    ht.cfg.normalization_type = "LNPre"
    with pytest.raises(ValueError, match="fold_ln"):
        from_hooked_transformer(ht)
