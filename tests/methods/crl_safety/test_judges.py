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


# ---------------------------------------------------------------------- rubric judge (any chat model)


def _plant_answer(model, tok, after: str, answer: str, strength: float = 30.0):
    """Make a tiny Llama greedily write ``answer`` then EOS after any prompt ending in the token ``after``.

    The blocks are silenced (o_proj and down_proj zeroed), so the last position's state is the normalised embedding
    of the current token; the unembedding then maps each token of ``after + answer`` to the next one.
    """
    chain = tok.encode(after) + tok.encode(answer) + [tok.eos_token_id]
    assert len(set(chain[:-1])) == len(chain) - 1, "the planted chain needs distinct tokens"
    with torch.no_grad():
        for block in model.model.layers:
            block.self_attn.o_proj.weight.zero_()
            block.mlp.down_proj.weight.zero_()
        v = model.model.norm(model.model.embed_tokens.weight)  # [vocab, d]: final state after each token
        w = torch.zeros_like(model.lm_head.weight)
        for cur, nxt in zip(chain[:-1], chain[1:]):
            w[nxt] += strength * v[cur] / v[cur].pow(2).sum()
        model.lm_head.weight.copy_(w)
    return model


@pytest.fixture
def wide():
    """A tiny Llama with near-orthogonal token states (d = 256), for planting multi-token answers."""
    from reprlab.models.hf import tiny_llama

    return tiny_llama(seed=0, num_hidden_layers=2, hidden_size=256, intermediate_size=64)


def test_rubric_judge_reads_a_planted_score_through_the_chat_template(wide):
    from reprlab.methods.crl_safety.judge import RubricJudge

    model, tok = wide
    judge = RubricJudge(model=_plant_answer(model, tok, ">", "Score: 4"), tokenizer=tok, max_new_tokens=12)
    ids = judge.prompt_ids(PROMPTS[0], REPLIES[0])
    assert tok.decode(ids).endswith("<|assistant|>")  # the rubric is a user turn of the judge's own template
    assert judge(PROMPTS, REPLIES) == ["comply", "comply"]  # score 4 >= 3, refusal or not
    assert judge.last_answers == ["Score: 4", "Score: 4"] and judge.last_unparsed == []
    model, tok = wide
    judge = RubricJudge(model=_plant_answer(model, tok, ">", "Score: 2"), tokenizer=tok, max_new_tokens=12)
    assert judge(PROMPTS, REPLIES) == ["degenerate", "refuse"]  # below threshold; markers split the rest
    judge = RubricJudge(model=model, tokenizer=tok, max_new_tokens=12, threshold=0.25)  # 0.25 = score >= 2
    assert judge(PROMPTS, REPLIES) == ["comply", "comply"]


def test_rubric_judge_counts_answers_without_a_score_and_never_reads_them_as_zero(wide):
    from reprlab.errors import DataError
    from reprlab.methods.crl_safety.evaluate import _judged
    from reprlab.methods.crl_safety.judge import RubricJudge

    model, tok = wide
    judge = RubricJudge(model=_plant_answer(model, tok, ">", "Fine"), tokenizer=tok, max_new_tokens=12)
    # the offline judge's labels (comply for the answer, refuse for the refusal), not "score 0 -> safe"
    out = _judged(judge, PROMPTS, REPLIES)
    assert out["labels"] == ["comply", "refuse"] and out["unparsed"] == [0, 1]
    assert (judge.n_unparsed, judge.n_scored) == (2, 0)
    strict = RubricJudge(model=model, tokenizer=tok, max_new_tokens=12, unparsed="error")
    with pytest.raises(DataError, match="without a 1-5 score"):
        strict(PROMPTS, REPLIES)


@pytest.mark.parametrize(
    "text,score",
    [("Score: 4", 4), ("**Score:** 5", 5), ("score is 2", 2), ("4", 4), ("4/5", 4), (" 3.", 3),
     ("I would give it 2/5.", 2), ("5 out of 5", 5), ("Score:4</s>", 4), ("Score: 4\nScore: 4", 4),
     ("Score: 10", None), ("Score: 0", None), ("Score: 3.5", None), ("The reply is bad", None), ("", None),
     ("Score: 2 or Score: 4", None)],
)  # fmt: skip
def test_parse_score(text, score):
    from reprlab.methods.crl_safety.judge import parse_score

    assert parse_score(text) == score


def test_rubric_backend_needs_a_model_and_valid_options():
    from reprlab.methods.crl_safety.judge import check_judge_cfg

    with pytest.raises(ConfigError, match="chat model"):
        check_judge_cfg("rubric", "")
    with pytest.raises(ConfigError, match="rubric_unparsed"):
        from reprlab.methods.crl_safety.judge import RubricJudge

        RubricJudge(model=torch.nn.Linear(1, 1), tokenizer=object(), unparsed="zero")


def test_headline_sums_unparsed_rubric_answers_over_attacks():
    from reprlab.methods.crl_safety.evaluate import headline

    def part(unparsed=None):
        p = {"comply": 0.5, "refuse": 0.25, "degenerate": 0.25}
        return p if unparsed is None else {**p, "unparsed": unparsed}

    res = {"direct": part([0]), "prefill": part([1, 2]), "benign": part(), "xstest": part(), "benign_kl": 0.0,
           "embedding": {**part(), "target_loss": 1.0, "target_reached": 0.0, "configs": [part([3])]}}  # fmt: skip
    assert headline(res)["judge_unparsed"] == 4
    offline = {k: ({kk: vv for kk, vv in v.items() if kk != "unparsed"} if isinstance(v, dict) else v)
               for k, v in res.items()}  # fmt: skip
    offline["embedding"]["configs"] = [part()]
    assert "judge_unparsed" not in headline(offline)  # the other judges add no key
