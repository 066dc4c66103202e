"""Truncation is never silent: long texts keep every piece the model accepts, cuts raise or warn with counts.

``max_pieces=64`` once silently cut the length experiment's prefixes, which manufactured part of the CLS
"fixed point". The oracle for the kept states is the model run directly on the whole sequence.
"""

import pytest
import torch

from reprlab.methods.norm_ic.extract import TruncationError, context_limit, extract_states
from reprlab.models.hf import tiny_llama

TOL = dict(atol=1e-4, rtol=1e-4)  # padded batch vs one unpadded sequence reorders float32 sums


@pytest.fixture(scope="module")
def llama():
    return tiny_llama(seed=0)  # byte tokenizer: one piece per byte; 256 positions


def test_long_text_keeps_every_piece_by_default(llama):
    model, tok = llama
    text = "word " * 20 + "end"  # 104 bytes with the leading space: more than the old 64-piece cap
    st = extract_states(model, tok, [text, "a"], "decoder", layers=(-1,), bypass_final_norm=False)
    n = len(" " + text)
    assert st.mask.sum(1).tolist() == [n, 2] and st.n_truncated == 0 and st.limit == 256 - 2
    ids = torch.tensor([[tok.bos_token_id, *tok.encode(" " + text), tok.eos_token_id]])
    with torch.inference_mode():
        ref = model(input_ids=ids, output_hidden_states=True).hidden_states[-1][0]
    torch.testing.assert_close(st.states[0, 0, :n], ref[1 : 1 + n], **TOL)
    torch.testing.assert_close(st.pooled[0, 0], ref[1 + n], **TOL)  # the EOS after the *whole* text


def test_cut_raises_with_counts_by_default(llama):
    model, tok = llama
    with pytest.raises(
        TruncationError, match=r"1 of 2 texts .* max_pieces=10 .* longest 31 pieces, 21 pieces cut"
    ):
        extract_states(model, tok, ["x" * 30, "short"], "decoder", max_pieces=10)


def test_cut_warns_with_counts_and_records_them(llama):
    model, tok = llama
    with pytest.warns(UserWarning, match=r"TRUNCATED: 2 of 3 texts"):
        st = extract_states(
            model, tok, ["x" * 30, "y" * 12, "ab"], "decoder", max_pieces=10, on_truncate="warn"
        )
    assert st.n_truncated == 2 and st.n_pieces.tolist() == [31, 13, 3]
    assert st.mask.sum(1).tolist() == [10, 10, 3]


def test_model_context_caps_max_pieces_and_is_reported(llama):
    model, tok = llama
    assert context_limit(model, tok) == 254
    with pytest.raises(TruncationError, match="the model's context"):
        extract_states(model, tok, ["z" * 300], "decoder", max_pieces=1000)
    with pytest.warns(UserWarning, match="the model's context allows \\(254\\)"):
        st = extract_states(model, tok, ["z" * 300], "decoder", on_truncate="warn")
    assert st.mask.sum().item() == 254 and st.n_pieces.item() == 301


def test_minilm_eighty_word_document_is_not_cut():
    """A 68-word document (more than 64 WordPiece pieces) through MiniLM keeps all its pieces."""
    from reprlab.models.hf import load_encoder

    model, tok = load_encoder("all-minilm-l6-v2")
    doc = " ".join(["the", "committee", "unanimously", "postponed", "its", "deliberations"] * 14)[:600]
    n = len(tok(doc, add_special_tokens=False)["input_ids"])
    assert n > 64
    st = extract_states(model, tok, [doc], "encoder", layers=(-1,))
    assert int(st.mask.sum()) == n and st.limit == 510
    with torch.inference_mode():
        ref = model(**tok([doc], return_tensors="pt")).last_hidden_state[0]
    torch.testing.assert_close(st.pooled[0, 0], ref[0], **TOL)  # CLS attended to every piece
