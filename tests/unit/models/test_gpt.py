"""Our hookable GPT against Hugging Face GPT2LMHeadModel with the same weights (the minGPT-style oracle)."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from reprlab.models.gpt import GPT, GPTConfig, from_hf_gpt2, to_hf_gpt2

# float32 with different op orders (fused qkv, SDPA vs eager attention): 1e-5 absolute on O(1) logits
ATOL = 1e-5


def _hf(seed: int = 0, act: str = "gelu_new") -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    cfg = GPT2Config(
        vocab_size=23,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_inner=48,
        activation_function=act,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    hf = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # HF's init leaves LN at (1, 0) and biases at 0: randomise them so they are tested
        for name, p in hf.named_parameters():
            if "ln" in name or "bias" in name:
                p.add_(0.1 * torch.randn_like(p))
    return hf


@pytest.mark.parametrize("act", ["gelu_new", "gelu"])
def test_forward_equals_hf_gpt2(act):
    hf = _hf(act=act)
    ours = from_hf_gpt2(hf).eval()
    ids = torch.randint(0, 23, (3, 16))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, atol=ATOL, rtol=0)


def test_to_hf_round_trip():
    torch.manual_seed(1)
    ours = GPT(GPTConfig(d_vocab=17, n_ctx=12, n_layers=2, d_model=32, n_heads=2, d_mlp=64)).eval()
    hf = to_hf_gpt2(ours).eval()
    ids = torch.randint(0, 17, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), atol=ATOL, rtol=0)


def test_causal_and_length_checks():
    torch.manual_seed(0)
    m = GPT(GPTConfig(d_vocab=11, n_ctx=8, n_layers=1, d_model=16, n_heads=2, d_mlp=32)).eval()
    ids = torch.randint(0, 11, (2, 8))
    ids2 = ids.clone()
    ids2[:, 5:] = (ids2[:, 5:] + 1) % 11
    with torch.no_grad():  # causal: changing later tokens leaves earlier logits unchanged
        torch.testing.assert_close(m(ids)[:, :5], m(ids2)[:, :5])
    with pytest.raises(ValueError, match="n_ctx"):
        m(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(d_model=30, n_heads=4)


@pytest.mark.parametrize("length", [5, 13, 15, 16])
def test_padded_attention_equals_hf_at_every_length(length):
    """CPU attention pads to a multiple of 16 (speed); results must equal HF GPT-2's unpadded eager path."""
    hf = _hf()
    ours = from_hf_gpt2(hf).eval()
    ids = torch.randint(0, 23, (3, length))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("n_layers", [0, 1, 2])
def test_start_returns_the_suffix_of_the_full_logits(n_layers):
    torch.manual_seed(2)
    m = GPT(GPTConfig(d_vocab=11, n_ctx=15, n_layers=n_layers, d_model=16, n_heads=2, d_mlp=32)).eval()
    ids = torch.randint(0, 11, (4, 15))
    with torch.no_grad():
        full = m(ids)
        for start in (0, 1, 9, 14):
            out = m(ids, start=start)
            assert out.shape == (4, 15 - start, 11)
            torch.testing.assert_close(out, full[:, start:], atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="start"):
        m(ids, start=15)
