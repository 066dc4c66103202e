import pytest
import torch

from reprlab.methods.crl_safety.chat import collate, forward
from reprlab.methods.crl_safety.layers import find_decoder_layers, num_layers, parse_layers
from reprlab.models.lora import AdapterParams, add_lora


def test_find_decoder_layers_plain_and_peft(tiny):
    model, _ = tiny
    name, blocks = find_decoder_layers(model)
    assert name == "model.layers" and len(blocks) == 4
    peft = add_lora(model, r=4, alpha=4, blocks=[0, 1])
    name, blocks = find_decoder_layers(peft)
    assert name.endswith("model.layers") and len(blocks) == num_layers(peft) == 4


def test_find_decoder_layers_gpt2_naming():
    from transformers import GPT2Config, GPT2LMHeadModel

    m = GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=16, n_head=2, vocab_size=50, n_positions=32))
    name, blocks = find_decoder_layers(m)
    assert name == "transformer.h" and len(blocks) == 3


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("third:-2", list(range(10, 29))),
        ("third,two_thirds", [10, 20]),
        ("0:third", list(range(0, 11))),
        ("all", list(range(31))),
        ("3,1,3", [1, 3]),
    ],
)
def test_parse_layers_for_30_blocks(spec, expected):
    # [ours] target layers ceil(L/3)..L-2 = 10..28 for SmolLM2's 30 blocks
    assert parse_layers(spec, 30) == expected


def test_parse_layers_rejects_out_of_range():
    with pytest.raises(ValueError, match="outside"):
        parse_layers("0:40", 30)


def test_lora_at_init_equals_base_hidden_states(tiny, fmt):
    """B = 0 at init, so every hidden state of the LoRA model equals the base model's (LoRA's zero init)."""
    model, tok = tiny
    b = collate(
        [(fmt.prompt_ids("How do I bake bread?"), [5, 6, 7]), (fmt.prompt_ids("Hi"), [8])], tok.pad_token_id
    )
    with torch.no_grad():
        base = forward(model, b.attention_mask, input_ids=b.input_ids, logits_last=None)
        peft = add_lora(model, r=8, alpha=16, dropout=0.0)
        lora = forward(peft, b.attention_mask, input_ids=b.input_ids, logits_last=None)
    for h0, h1 in zip(base.hidden_states, lora.hidden_states, strict=True):
        torch.testing.assert_close(h1, h0, rtol=0, atol=0)  # exact: the LoRA branch adds B·A·x with B = 0
    # the adapters exist and are trainable, the base weights are frozen
    names = [n for n, p in peft.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)


def test_lora_blocks_restricts_adapters(tiny):
    model, _ = tiny
    peft = add_lora(model, r=2, alpha=2, blocks=[1])
    touched = {n.split("layers.")[1].split(".")[0] for n, p in peft.named_parameters() if p.requires_grad}
    assert touched == {"1"}


def test_adapter_params_roundtrip(tiny):
    model, _ = tiny
    peft = add_lora(model, r=2, alpha=2)
    ap = AdapterParams(peft)
    state = {k: torch.randn_like(v) for k, v in ap.state_dict().items()}
    ap.load_state_dict(state)
    live = dict(peft.named_parameters())
    k = next(iter(state))
    torch.testing.assert_close(
        live[k.replace("__", ".")], state[k]
    )  # shared storage: load writes into the model
