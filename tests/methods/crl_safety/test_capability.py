"""Capability: the offline multiple-choice check and lm-evaluation-harness by task name (offline, local task)."""

import json
import socket

import pytest
import torch

from reprlab.errors import ConfigError, DataError
from reprlab.methods.crl_safety.capability import (
    _pair,
    choice_loglik,
    load_mc,
    mc_accuracy,
    shared_context_loglik,
)

ITEMS = [
    {
        "question": "What is the capital of France?",
        "choices": ["Paris", "Berlin", "Madrid", "Rome"],
        "answer": 0,
    },
    {
        "question": "How many legs does a spider have?",
        "choices": ["four", "six", "eight", "ten"],
        "answer": 2,
    },
    {"question": "What do bees make?", "choices": ["milk", "honey", "silk"], "answer": 1},
    {
        "question": "Which planet do we live on?",
        "choices": ["Mars", "Earth", "Venus", "Jupiter"],
        "answer": 1,
    },
    {"question": "What is frozen water called?", "choices": ["steam", "ice", "sand", "oil"], "answer": 1},
    {"question": "What color is the sky on a clear day?", "choices": ["green", "blue", "red"], "answer": 1},
]


def _hf_tokenizer(texts):
    """A small byte-level BPE ``PreTrainedTokenizerFast`` trained here (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))  # fmt: skip
    return PreTrainedTokenizerFast(tokenizer_object=t, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")  # fmt: skip


@pytest.fixture
def lm():
    from reprlab.models.hf import tiny_llama

    texts = [f"Question: {it['question']}\nAnswer: {c}" for it in ITEMS for c in it["choices"]]
    tok = _hf_tokenizer(texts)
    model, _ = tiny_llama(seed=0, num_hidden_layers=2, vocab_size=len(tok), initializer_range=0.3)
    return model, tok


def _plant_answers(model, tok, items):
    """An output bias of -30 on every token that no right answer uses, so only right choices are likely."""
    ids = lambda it, c: tok.encode(" " + it["choices"][c], add_special_tokens=False)  # noqa: E731
    allowed = {t for it in items for t in ids(it, it["answer"])}
    for it in items:  # every wrong choice needs a token outside the right answers' (true for ITEMS)
        assert all(set(ids(it, c)) - allowed for c in range(len(it["choices"])) if c != it["answer"])
    bias = torch.full((model.lm_head.out_features,), -30.0)
    bias[sorted(allowed)] = 0.0
    head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.copy_(bias)
    model.lm_head = head
    return model


def test_packaged_mc_set_loads_and_user_files_are_validated(tmp_path):
    items = load_mc()
    assert len(items) == 40 and all(len(it["choices"]) == 4 for it in items)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps(ITEMS[0]) + "\n" + json.dumps({"question": "q", "choices": ["a", "b"], "answer": 2})
    )
    with pytest.raises(DataError, match=r"bad.jsonl:2: \"answer\""):
        load_mc(bad)
    bad.write_text(json.dumps({"question": "q", "choices": ["a", "b"], "answer": True}))
    with pytest.raises(DataError, match="bad.jsonl:1"):
        load_mc(bad)


def test_mc_accuracy_follows_the_planted_answers(lm):
    model, tok = lm
    _plant_answers(model, tok, ITEMS)
    out = mc_accuracy(model, tok, ITEMS)
    assert out["acc"] == 1.0 and out["n"] == 6
    assert out["chance"] == pytest.approx((4 * 0.25 + 2 / 3) / 6)
    wrong = [{**it, "answer": (it["answer"] + 1) % len(it["choices"])} for it in ITEMS]
    assert mc_accuracy(model, tok, wrong)["acc"] == 0.0


def test_shared_context_scoring_equals_scoring_every_sequence(lm):
    """Each context run once with its KV cache serving its choices gives each choice's log-likelihood as scoring the
    whole (context, choice) sequences in padded batches (the slow path), on choices of 1 to several tokens."""
    from reprlab.models.lora import add_lora

    model, tok = lm
    pairs = [
        _pair(tok, f"Question: {it['question']}\nAnswer:", f" {c}") for it in ITEMS for c in it["choices"]
    ]
    assert len({len(c) for _, c in pairs}) > 1  # choices of different lengths share a context
    ctx = pairs[0][0]
    pairs += [(ctx[:5], [7]), (ctx[:5], [9]), (ctx[:4], [11]), (ctx[:4], [12, 13])]  # one-token choices too
    peft = add_lora(model, r=4, alpha=8, dropout=0.0)
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_(
                    0, 0.3
                )  # an active adapter: the cache-keyword lookup must see through peft's wrapper
    for m in (model, peft):
        want = choice_loglik(m, tok, pairs, batch_size=5)
        got = shared_context_loglik(m, tok, pairs)
        # float32: the cached path sums attention and log-probabilities in another order
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=1e-5)


class _NoNetwork:
    """Any socket connection or DNS lookup fails the test."""

    def __enter__(self):
        self._saved = socket.socket.connect, socket.create_connection, socket.getaddrinfo

        def refuse(*a, **k):
            raise AssertionError(f"network access attempted: {a[:2]}")

        socket.socket.connect, socket.create_connection, socket.getaddrinfo = refuse, refuse, refuse
        return self

    def __exit__(self, *exc):
        socket.socket.connect, socket.create_connection, socket.getaddrinfo = self._saved


def test_lm_eval_local_task_matches_our_mc_check_offline(lm, tmp_path, monkeypatch):
    """A local multiple-choice task YAML over a local JSONL, run through lm_eval's HFLM on the in-memory model,
    with every socket blocked: lm_eval's acc and acc_norm equal our offline check's on the same items."""
    pytest.importorskip("lm_eval")
    from reprlab.methods.crl_safety.capability import lm_eval_tasks
    from reprlab.models.lora import add_lora

    for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(k, "1")
    model, tok = lm
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(it) + "\n" for it in ITEMS))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "tiny_mc.yaml").write_text(
        "task: reprlab_tiny_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\n'
        "doc_to_choice: choices\n"
        "doc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))
    # a LoRA with a non-zero B: lm_eval must see the adapted model, not the base weights
    peft = add_lora(model, r=4, alpha=8, dropout=0.0)
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(3))
    tasks = str(tmp_path / "tasks")
    ours = mc_accuracy(peft, tok, ITEMS)
    with peft.disable_adapter():
        base = mc_accuracy(peft, tok, ITEMS)
    assert (ours["acc"], ours["acc_norm"]) != (
        base["acc"],
        base["acc_norm"],
    )  # the adapter changes the answers
    with _NoNetwork():
        got = lm_eval_tasks(peft, tok, ["reprlab_tiny_mc"], include_path=tasks, batch_size=4)
        with peft.disable_adapter():
            got_base = lm_eval_tasks(peft, tok, ["reprlab_tiny_mc"], include_path=tasks, batch_size=4)
    for res, ref in ((got, ours), (got_base, base)):
        assert res["reprlab_tiny_mc"]["acc,none"] == pytest.approx(ref["acc"])
        assert res["reprlab_tiny_mc"]["acc_norm,none"] == pytest.approx(ref["acc_norm"])


def test_lm_eval_option_is_checked_before_any_model_loads(tmp_path):
    from reprlab.methods.crl_safety.capability import check_lm_eval

    check_lm_eval([])  # off: nothing to check
    with pytest.raises(ConfigError, match="include_path"):
        check_lm_eval(["hellaswag"], str(tmp_path / "missing"))
