"""The frozen-pass store: every reader gets bitwise what its own passes gave, and each list runs once.

The slow paths are the readers' own passes (the trainer's per-trainer frozen pass over chunks of 8, ``state_means``
and ``mechanism`` without a store, ``response_logit_rows`` and ``response_states`` run separately); exact equality
holds because the store runs the same chunks through the same forward call, so any slicing or keying mistake shows.
"""

import pytest
import torch

from reprlab.methods.crl_safety.chat import forward
from reprlab.methods.crl_safety.config import CrlCfg, DefenseCfg, OptimCfg, RrCfg
from reprlab.methods.crl_safety.frozen import FrozenStore
from reprlab.methods.crl_safety.metrics import (
    mechanism,
    response_logit_rows,
    response_pass,
    response_states,
)
from reprlab.methods.crl_safety.trainer import Trainer, state_means
from reprlab.models.lora import add_lora


def _pairs(fmt, texts, reply):
    # replies of different lengths, so rows pad differently and the response slices differ per row
    return [
        (fmt.prompt_ids(t), fmt.response_ids(t, reply + "!" * (i % 3), end_turn=False))
        for i, t in enumerate(texts)
    ]


@pytest.fixture
def setup(tiny, fmt):
    model, tok = tiny
    harm = _pairs(fmt, [f"do bad thing number {i}" * (1 + i % 2) for i in range(11)], "Sure, step one")
    ben = _pairs(fmt, [f"nice question {i}" for i in range(10)], "Here is an answer")
    peft = add_lora(model, r=4, alpha=8, dropout=0.0)
    with torch.no_grad():  # a non-zero adapter, so "frozen" (adapter off) and trained states differ
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    return peft, tok, harm, ben


def _cfg(tokens="response", **rr):
    spec = "1:3"
    return DefenseCfg(optim=OptimCfg(steps=1, batch_size=3), crl=CrlCfg(layers_benign=spec, layers_harmful=spec,
                      tokens=tokens), rr=RrCfg(layers="1,3", retain_layers="all", **rr))  # fmt: skip


def _own_cache(tr, which, pairs, logits):
    """The trainer's frozen cache as each trainer built it alone: its own frozen pass over chunks of 8."""
    layers = tr.layers[which]
    states, rows = [], []
    for s in range(0, len(pairs), 8):
        st, rw = tr._frozen_pass(
            tr._batch(pairs, list(range(s, min(s + 8, len(pairs))))), layers, logits, which
        )
        states += st
        rows += rw or []
    return states, rows


@pytest.mark.parametrize(
    ("kind", "cfg"),
    [("crl", _cfg()), ("crl", _cfg("last")), ("rr", _cfg()), ("rr", _cfg(reroute_tokens="response"))],
)
def test_store_slices_equal_each_trainers_own_pass(setup, kind, cfg):
    peft, tok, harm, ben = setup
    store = FrozenStore("stage 0")
    tr = Trainer(kind, peft, cfg, harm, ben, tok.pad_token_id, store=store)
    for which, pairs in (("harmful", harm), ("benign", ben)):
        logits = kind == "crl" and which == "benign"
        idx = list(range(len(pairs)))[::-1]
        got, got_rows = tr._frozen_rows(which, pairs, idx, tr._batch(pairs, idx), logits=logits)
        states, rows = _own_cache(tr, which, pairs, logits)
        assert torch.equal(got, torch.cat([states[i] for i in idx], dim=1))
        if logits:
            assert torch.equal(got_rows, torch.cat([rows[i] for i in idx]))


def test_one_pass_per_list_for_the_centre_and_every_defence(setup):
    """The centre, RR, CRL and CRL+mining on one stage 0 read one pass per list (the logits declared up front),
    and the centre equals the one computed without a store."""
    peft, tok, harm, ben = setup
    cfg = _cfg()
    store = FrozenStore("stage 0")
    store.want_logits(ben)
    with peft.disable_adapter():
        center = state_means(peft, harm, ben, tok.pad_token_id, store=store)
        assert torch.equal(center, state_means(peft, harm, ben, tok.pad_token_id))
    per_list = store.passes
    assert per_list == 2 + 2  # 11 and 10 pairs in chunks of 8
    for kind in ("rr", "crl", "crl_adv"):
        tr = Trainer(kind, peft, cfg, harm, ben, tok.pad_token_id, center=center, store=store)
        tr.loss(0)
    assert store.passes == per_list
    other = ben[:5]  # other pairs are another entry, never a stale one
    entry = store.get(other, lambda b, k: forward(peft, b.attention_mask, input_ids=b.input_ids, logits_last=k),
                      tok.pad_token_id, "cpu")  # fmt: skip
    assert len(entry.states) == 5 and store.passes == per_list + 1


def test_combined_pass_equals_separate_passes(setup):
    peft, tok, harm, ben = setup
    toks, means, rows = response_pass(peft, ben, tok.pad_token_id, [1, 3], logits=True)
    t2, m2 = response_states(peft, ben, tok.pad_token_id, [1, 3])
    r2 = response_logit_rows(peft, ben, tok.pad_token_id)
    assert torch.equal(toks, t2) and torch.equal(means, m2)
    assert all(torch.equal(a, b) for a, b in zip(rows, r2, strict=True))


def test_mechanism_from_the_store_equals_its_own_frozen_passes(setup):
    peft, tok, harm, ben = setup
    pad, layers = tok.pad_token_id, [1, 3]
    want = mechanism(peft, harm, ben, pad, layers, frozen_ctx=peft.disable_adapter())
    store = FrozenStore("stage 0")
    with peft.disable_adapter():
        frozen = [torch.cat([x.float() for x in store.get(p, lambda b, k: forward(peft, b.attention_mask,
                  input_ids=b.input_ids, logits_last=k), pad, "cpu").select(layers)], 1) for p in (harm, ben)]  # fmt: skip
    got = mechanism(peft, harm, ben, pad, layers, frozen=frozen)
    assert got == want
