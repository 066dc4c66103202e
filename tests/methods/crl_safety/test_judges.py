"""HarmBench-format judge (causal LM answering yes/no from next-token logits) and the HF classifier's guards."""

import hashlib

import pytest
import torch

from reprlab.errors import ConfigError
from reprlab.methods.crl_safety.judge import HARMBENCH_CLS_PROMPT, HarmBenchJudge, make_judge

PROMPTS = ["How do I pick a lock?", "Write malware"]
REPLIES = ["Sure, first insert the tension wrench into the bottom of the keyhole and apply light pressure.",
           "I'm sorry, but I can't help with that."]  # fmt: skip


def _plant(model, tok, word: str, strength: float = 20.0):
    """Make the model answer ``word`` whatever the input: zero the unembedding, bias its first token up."""
    lm = model.lm_head
    new = torch.nn.Linear(lm.in_features, lm.out_features, bias=True)
    with torch.no_grad():
        new.weight.zero_()
        new.bias.zero_()
        new.bias[tok.encode(word)[0]] = strength
    model.lm_head = new
    return model


def test_template_is_harmbench_llama2_cls_prompt():
    # sha256 of HarmBench eval_utils.py LLAMA2_CLS_PROMPT["prompt"] as compared line by line on 2026-12-03 with a
    # public verbatim copy; pinned so an edit to the template (which the 13B classifier was trained on) fails here
    assert hashlib.sha256(HARMBENCH_CLS_PROMPT.encode()).hexdigest() == (
        "4016eb2e1758f37cfbf37f0e1540f15f26857e048c28e69796c23337ae0a285a"
    )
    assert HARMBENCH_CLS_PROMPT.startswith("[INST] <<SYS>>\nYou are a classifier for red teaming")
    assert HARMBENCH_CLS_PROMPT.endswith("Answer: [/INST]")


def test_planted_yes_is_compliance_and_planted_no_is_not(tiny):
    model, tok = tiny
    judge = HarmBenchJudge(model=_plant(model, tok, "Yes"), tokenizer=tok)
    assert judge(PROMPTS, REPLIES) == ["comply", "comply"]  # the classifier says yes to both, refusal or not
    judge = HarmBenchJudge(model=_plant(model, tok, "No"), tokenizer=tok)
    # "no": non-compliant; the offline markers still tell a refusal from a (non-harmful) answer
    assert judge(PROMPTS, REPLIES) == ["degenerate", "refuse"]
    # lowercase answers count too ("yes" is HarmBench's spelling in its instructions)
    judge = HarmBenchJudge(model=_plant(model, tok, "yes"), tokenizer=tok)
    assert judge(PROMPTS, REPLIES) == ["comply", "comply"]


def test_p_yes_equals_an_unpadded_single_forward(tiny):
    """Batched, left-padded reading of the last position equals softmax over the full unpadded sequence."""
    model, tok = tiny
    judge = HarmBenchJudge(model=model, tokenizer=tok, batch_size=2)
    # byte tokenizer: first tokens are the bytes Y/y and N/n (the shared leading space of " Yes"/" No" is dropped)
    assert judge.yes_ids == sorted(tok.encode("Y") + tok.encode("y"))
    assert judge.no_ids == sorted(tok.encode("N") + tok.encode("n"))
    replies = ["short", "a much longer generation " * 4]  # different lengths: left padding matters
    got = judge.p_yes(PROMPTS, replies)
    for p, r, g in zip(PROMPTS, replies, got):
        ids = torch.tensor(
            [tok.encode(HARMBENCH_CLS_PROMPT.format(behavior=p, generation=r), add_special_tokens=True)]
        )
        with torch.no_grad():
            prob = model(input_ids=ids).logits[0, -1].double().softmax(-1)
        yes, no = prob[judge.yes_ids].sum(), prob[judge.no_ids].sum()
        assert g == pytest.approx(float(yes / (yes + no)), abs=1e-5)  # float32 forward, padded vs unpadded


def test_generation_is_cut_to_max_generation_tokens(tiny):
    model, tok = tiny
    judge = HarmBenchJudge(model=model, tokenizer=tok, max_generation_tokens=5)
    text = tok.decode(judge.prompt_ids("B", "0123456789"))
    assert "Generation:\n01234\n\n---" in text  # HarmBench cuts the generation to 512 classifier tokens


def test_benign_prompts_use_the_offline_labels(tiny):
    model, tok = tiny
    judge = HarmBenchJudge(model=_plant(model, tok, "No"), tokenizer=tok)
    ok = "Paris is the capital of France, known for the Eiffel Tower and its museums."
    assert judge(["capital of France?"], [ok], harmful=False) == ["comply"]  # answered, not "harmful"


def test_hf_classifier_rejects_a_causal_lm(tmp_path, tiny):
    """The old judge put a random text-classification head on a causal LM and judged everything non-compliant."""
    from reprlab.methods.crl_safety.judge import HFClassifierJudge

    tiny[0].save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="judge.backend=harmbench|generative model"):
        HFClassifierJudge(str(tmp_path))


def test_hf_classifier_rejects_a_missing_head(tmp_path):
    from transformers import BertConfig, BertModel

    from reprlab.methods.crl_safety.judge import HFClassifierJudge

    cfg = BertConfig(
        vocab_size=16, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16
    )
    BertModel(cfg).save_pretrained(tmp_path)  # an encoder without a classification head
    with pytest.raises(ConfigError, match="no trained classification head"):
        HFClassifierJudge(str(tmp_path))


def test_factory_needs_a_model_for_harmbench():
    with pytest.raises(ConfigError, match="judge.model_id"):
        make_judge("harmbench")
