"""Batched extraction: equals the per-word loop, bypasses the final norm, and its surprisal is the LM's."""

import os

import pytest
import torch

from reprlab.methods.norm_ic.compose import compose
from reprlab.methods.norm_ic.extract import extract_states, final_norm, input_table_states, resolve_layers
from reprlab.models.hf import tiny_llama

os.environ.setdefault("HF_HUB_OFFLINE", "1")
WORDS = ["cat", "a", "unbelievably", "tree house"]
TOL = dict(atol=1e-4, rtol=1e-4)  # padded vs unpadded attention reorders float32 sums


@pytest.fixture(scope="module")
def llama():
    return tiny_llama(seed=0)


def test_decoder_batched_equals_per_word_loop(llama):
    model, tok = llama
    batched = extract_states(model, tok, WORDS, "decoder", layers=(0, 1, -1), batch_size=4)
    naive = extract_states(model, tok, WORDS, "decoder", layers=(0, 1, -1), batch_size=1)
    torch.testing.assert_close(batched.states, naive.states, **TOL)
    torch.testing.assert_close(batched.pooled, naive.pooled, **TOL)
    torch.testing.assert_close(batched.surprisal, naive.surprisal, **TOL)
    assert batched.mask.sum(1).tolist() == [len(" " + w) for w in WORDS]  # byte tokenizer: one piece per byte


def test_decoder_final_norm_bypass_and_surprisal(llama):
    model, tok = llama
    st = extract_states(model, tok, ["dog"], "decoder", layers=(-1,), bypass_final_norm=True)
    ids = torch.tensor([[tok.bos_token_id, *tok.encode(" dog"), tok.eos_token_id]])
    with torch.inference_mode():
        out = model(input_ids=ids, output_hidden_states=True)
    normed = out.hidden_states[-1][0, 1:4]  # HF's last hidden state has the final RMSNorm applied
    torch.testing.assert_close(final_norm(model)(st.states[0, 0, :3]), normed, **TOL)
    assert not torch.allclose(st.states[0, 0, :3], normed, **TOL)
    logp = out.logits[0].log_softmax(-1)
    ref = -logp[torch.arange(0, 3), ids[0, 1:4]]  # position j predicts token j+1
    torch.testing.assert_close(st.surprisal[0, :3], ref, **TOL)
    no_bypass = extract_states(model, tok, ["dog"], "decoder", layers=(-1,), bypass_final_norm=False)
    torch.testing.assert_close(no_bypass.states[0, 0, :3], normed, **TOL)


def test_input_table_rows_and_layer_validation(llama):
    model, tok = llama
    st = extract_states(model, tok, ["ab", "abcd"], "decoder", layers=(0,))
    rows = input_table_states(model, st.piece_ids)
    table = model.get_input_embeddings().weight.detach()
    torch.testing.assert_close(rows[1, :5], table[st.piece_ids[1, :5]])
    assert rows[0, 3:].abs().sum() == 0  # padding rows are zero
    # a one-piece word composes to its own table row under every plain composition
    with pytest.warns(UserWarning, match="TRUNCATED: 1 of 1"):  # " a" is two byte pieces
        one = extract_states(model, tok, ["a"], "decoder", layers=(0,), max_pieces=1, on_truncate="warn")
    x = input_table_states(model, one.piece_ids)
    torch.testing.assert_close(compose("sum", x, one.mask), table[one.piece_ids[0, :1]])
    assert resolve_layers(model, (-1, 0)) == [2, 0]
    with pytest.raises(ValueError, match="out of range"):
        resolve_layers(model, (5,))
    with pytest.raises(ValueError, match="no texts"):
        extract_states(model, tok, [], "decoder")


def test_encoder_minilm_cls_and_batching():
    from reprlab.models.hf import load_encoder

    model, tok = load_encoder("all-minilm-l6-v2")
    batched = extract_states(model, tok, WORDS, "encoder", layers=(-1,), batch_size=4)
    naive = extract_states(model, tok, WORDS, "encoder", layers=(-1,), batch_size=1)
    torch.testing.assert_close(batched.states, naive.states, **TOL)
    enc = tok(["unbelievably"], return_tensors="pt")
    with torch.inference_mode():
        ref = model(**enc).last_hidden_state[0]
    k = enc["input_ids"].shape[1] - 2
    torch.testing.assert_close(batched.pooled[2, 0], ref[0], **TOL)  # CLS state
    torch.testing.assert_close(batched.states[2, 0, :k], ref[1 : 1 + k], **TOL)  # [CLS]/[SEP] excluded
    assert batched.surprisal is None
