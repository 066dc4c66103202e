"""User prompts the model writes itself (``data.n_self_benign``): the sampler on a scripted model (known answers),
on the packaged SmolLM2 (determinism, the global random state left alone), and the recipe's use of them (resuming
a folder without them: test_borderline.py)."""

from types import SimpleNamespace

import pytest
import torch

from reprlab.config import load_config
from reprlab.methods.crl_safety import recipe as R
from reprlab.methods.crl_safety.chat import ChatFormat
from reprlab.methods.crl_safety.self_prompts import SelfPrompts, sample_user_prompts, user_turn_prefix
from reprlab.models.hf import ByteTokenizer
from reprlab.runs import Run

from .test_recipe import TINY, compliant_jsonl


class Scripted(torch.nn.Module):
    """A causal LM that writes ``scripts[row % len(scripts)]`` token by token (probability 1), then ``x`` forever;
    its 'cache' is the number of steps taken."""

    def __init__(self, scripts: list[list[int]], vocab: int = 259):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.scripts, self.vocab, self.prefixes = scripts, vocab, []

    def forward(self, input_ids, use_cache=True, logits_to_keep=1, past_key_values=None):
        step = past_key_values or 0
        if step == 0:
            self.prefixes.append(input_ids[0].tolist())
        logits = torch.full((len(input_ids), 1, self.vocab), -1e9)
        for i in range(len(input_ids)):
            s = self.scripts[i % len(self.scripts)]
            logits[i, 0, s[step] if step < len(s) else 3 + ord("x")] = 0.0
        return SimpleNamespace(logits=logits, past_key_values=step + 1)


def _fmt():
    return ChatFormat(ByteTokenizer(), "", max_prompt_tokens=64)


def test_user_turn_prefix_is_the_template_up_to_the_users_words():
    fmt = _fmt()
    prefix, end = user_turn_prefix(fmt)
    tok = fmt.tokenizer
    assert tok.decode(prefix) == "<|system|>\n<|user|>"
    assert tok.decode(end) == "\n"
    # the prefix plus the words plus the end is exactly what the template renders for that prompt
    whole = tok.apply_chat_template([{"role": "system", "content": ""}, {"role": "user", "content": "hi"}])
    assert whole == [tok.bos_token_id, *prefix, *tok.encode("hi"), *end]


def test_the_sampler_keeps_complete_new_distinct_prompts_and_counts_the_rest():
    fmt = _fmt()
    tok = fmt.tokenizer
    nl = tok.encode("\n")
    scripts = [
        tok.encode("Tell me a joke about cats") + nl,  # kept
        tok.encode("tell me a   JOKE about cats") + nl,  # the same up to case and whitespace
        tok.encode("Hi there") + nl,  # short
        tok.encode("an endless turn that never stops talking"),  # no end within the budget
        tok.encode("How do I bake bread at home?") + nl,  # in the exclude set
        tok.encode("Explain how tides work, please") + [tok.eos_token_id],  # eos ends a turn too
    ]
    model = Scripted(scripts)
    got = sample_user_prompts(
        model, fmt, n=5, seed=0, max_new_tokens=45, exclude={"how do i bake bread at HOME?"}, batch_size=6,
        max_batches=1,
    )  # fmt: skip
    assert got.prompts == ["Tell me a joke about cats", "Explain how tides work, please"]
    assert (got.sampled, got.duplicate, got.short, got.incomplete, got.excluded) == (6, 1, 1, 1, 1)
    assert not got.complete  # 2 of the 5 asked for
    assert model.prefixes == [user_turn_prefix(fmt)[0]]  # one batch, every row from the template's user turn


def test_the_sampler_stops_once_it_has_enough():
    fmt = _fmt()
    tok = fmt.tokenizer
    scripts = [tok.encode(f"Write a poem about topic {i}") + tok.encode("\n") for i in range(4)]
    model = Scripted(scripts)
    got = sample_user_prompts(model, fmt, n=3, seed=0, batch_size=4, max_batches=5)
    assert got.prompts == [f"Write a poem about topic {i}" for i in range(3)]
    assert (got.sampled, got.surplus, got.diagnostics["batches"]) == (4, 1, 1) and got.complete
    assert len(model.prefixes) == 1  # one batch, not five


def test_repeats_are_dropped_across_batches_and_the_batch_budget_follows_n():
    fmt = _fmt()
    tok = fmt.tokenizer
    # the scripted model writes the same two turns in every batch
    scripts = [
        tok.encode("Name three rivers in Europe") + tok.encode("\n"),
        tok.encode("Summarise a short story") + tok.encode("\n"),
    ]
    got = sample_user_prompts(Scripted(scripts), fmt, n=3, seed=0, batch_size=2)
    assert got.prompts == ["Name three rivers in Europe", "Summarise a short story"] and not got.complete
    assert got.diagnostics["max_batches"] == 12  # enough for 8 n turns
    assert (got.sampled, got.duplicate) == (24, 22)
    assert (
        got.sampled
        == len(got.prompts) + got.incomplete + got.short + got.duplicate + got.excluded + got.surplus
    )


class InstTokenizer(ByteTokenizer):
    """A Mistral-style template: the user turn ends with a several-token ``[/INST]``."""

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True, **_):
        text = "".join(f"[INST] {m['content']} [/INST]" for m in messages if m["role"] == "user")
        return self.encode(text) if tokenize else text


def test_a_several_token_end_of_turn_ends_a_turn_and_its_first_token_alone_does_not():
    fmt = ChatFormat(InstTokenizer(), None, max_prompt_tokens=64)
    tok = fmt.tokenizer
    prefix, end = user_turn_prefix(fmt)
    assert tok.decode(prefix) == "[INST] " and tok.decode(end) == " [/INST]"
    scripts = [tok.encode("Explain what a[0] means in Python [briefly] [/INST] and more"),
               tok.encode("Explain what a[0] means in C [/ ok")]  # fmt: skip
    got = sample_user_prompts(
        Scripted(scripts), fmt, n=2, seed=0, max_new_tokens=60, batch_size=2, max_batches=1
    )
    assert got.prompts == ["Explain what a[0] means in Python [briefly]"]
    assert got.incomplete == 1


def test_smollm2_writes_user_prompts_deterministically_without_touching_the_global_rng():
    from reprlab.methods.crl_safety.self_prompts import _sample_turns
    from reprlab.models.hf import load_causal_lm

    model, tok = load_causal_lm("smollm2-135m-instruct")
    fmt = ChatFormat(tok, "", max_prompt_tokens=48)
    state = torch.get_rng_state()
    a = sample_user_prompts(model, fmt, n=2, seed=0, batch_size=16, max_batches=1)
    assert torch.equal(torch.get_rng_state(), state)
    assert a == sample_user_prompts(model, fmt, n=2, seed=0, batch_size=16, max_batches=1)
    # about 4 turns in 10 end within 48 tokens (64 of 160 on seed 0 in the recipe): none of 16 would be a 1e-3 draw
    assert a.prompts and all(len(p.split()) >= 4 for p in a.prompts)
    assert a.sampled == 16 == len(a.prompts) + a.incomplete + a.short + a.duplicate + a.excluded + a.surplus
    # the same seed writes the same raw turns, another seed other ones
    prefix, end = user_turn_prefix(fmt)
    turns = [
        _sample_turns(model, prefix, [end], 4, 8, 1.0, torch.Generator().manual_seed(s)) for s in (0, 0, 1)
    ]
    assert turns[0] == turns[1] and turns[0] != turns[2]


@pytest.mark.parametrize("role", ["benign", "retain"])
def test_only_answered_self_written_prompts_reach_the_defences_and_not_stage_0(tmp_path, monkeypatch, role):
    # role 'retain' (defense.crl.self_written): CRL's triplet benign set goes without them, its KL retain batch has
    # them; the borderline prompts keep their own (default) role either way
    crl = {"kl_data": "retain", "self_written": "retain"} if role == "retain" else {}
    t = {**TINY, "models": ["refusal", "rr", "crl"],
         "data": {**TINY["data"], "user_jsonl": compliant_jsonl(tmp_path), "n_self_benign": 3,
                  "n_borderline_train": 2},
         "defense": {**TINY["defense"], "crl": crl}}  # fmt: skip
    cfg = load_config(R.Config, t)
    sp = R._splits(cfg)
    written = ["Explain how tides work in simple words.", "Write a short poem about autumn leaves.",
               "List three uses of a paperclip."]  # fmt: skip
    asked = {}

    def fake_sampler(model, fmt, n, seed, exclude=frozenset(), **kw):
        asked.update(n=n, exclude=set(exclude))
        return SelfPrompts(list(written), n, sampled=7, incomplete=4)

    real = R.make_judge

    def judge_factory(*a, **kw):
        j = real(*a, **kw)

        def judge(prompts, responses, harmful=True):
            if prompts == written:  # the random tiny model's replies are degenerate: script these verdicts
                return ["comply", "refuse", "comply"]
            if prompts == sp.borderline_train:
                return ["comply"] * len(prompts)
            return j(prompts, responses, harmful=harmful)

        return judge

    seen, real_fit = {}, R._fit

    def fit(sharded, peft, kind, cfg_, harm, ben, *a, **kw):
        seen[kind] = (ben, kw.get("retain"))
        return real_fit(sharded, peft, kind, cfg_, harm, ben, *a, **kw)

    monkeypatch.setattr(R, "sample_user_prompts", fake_sampler)
    monkeypatch.setattr(R, "make_judge", judge_factory)
    monkeypatch.setattr(R, "_fit", fit)
    summary = R.run(cfg, Run.create(tmp_path / "run", cfg, "crl-tiny", quiet=True))
    used = [summary[f"self_benign_{k}"] for k in ("sampled", "kept", "used")]
    assert used == [7, 3, 2] and summary["borderline_train_used"] == 2  # each counted apart
    assert asked["n"] == 3
    every = (
        sp.harmless_eval
        + sp.harmful_eval
        + sp.xstest
        + sp.harmless_train
        + sp.harmful_train
        + sp.borderline_train
    )
    assert set(every) <= asked["exclude"] and sp.borderline_train
    tok = R.load_model(cfg, "cpu")[1]
    fmt = R.ChatFormat(tok, cfg.data.system_prompt, cfg.data.max_prompt_tokens)
    ids = {p: tuple(fmt.prompt_ids(p)) for p in written}
    prompts_of = lambda pairs: {tuple(p) for p, _ in pairs}  # noqa: E731
    kept, refused = {ids[written[0]], ids[written[2]]}, ids[written[1]]
    assert not prompts_of(seen["sft"][0]) & set(ids.values())  # stage 0 trains without them
    border = {tuple(fmt.prompt_ids(p)) for p in sp.borderline_train}
    for kind in ("rr", "crl"):
        ben, retain = seen[kind]
        if kind == "crl" and role == "retain":
            assert not prompts_of(ben) & set(ids.values())
        else:
            assert kept <= prompts_of(ben) and refused not in prompts_of(ben), kind
        assert border <= prompts_of(ben), kind
        assert kept <= prompts_of(retain) and refused not in prompts_of(retain), kind
