import torch

from reprlab.methods.crl_safety.chat import ChatFormat, collate, forward, generate, position_ids


def test_prompt_and_response_ids_follow_the_template(tiny, fmt):
    _, tok = tiny
    full = tok.apply_chat_template(
        [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there."}], tokenize=False
    )
    ids = fmt.prompt_ids("Hello") + fmt.response_ids("Hello", "Hi there.")
    assert tok.decode(ids) == full
    # truncated generations do not get the end-of-turn marker
    assert tok.decode(fmt.response_ids("Hello", "Hi there.", end_turn=False)) == "Hi there."


def test_suffix_split_brackets_the_user_content(tiny, fmt):
    _, tok = tiny
    pre, post = fmt.suffix_split("Tell me a joke")
    assert tok.decode(pre + tok.encode("XYZ") + post) == fmt.render_prompt("Tell me a jokeXYZ")


def test_system_prompt_is_sent_when_given(tiny):
    _, tok = tiny
    assert "<|system|>be brief" in ChatFormat(tok, "be brief").render_prompt("hi")
    assert "<|system|>" not in ChatFormat(tok, None).render_prompt("hi")


def test_left_padding_with_positions_equals_unpadded(tiny, fmt):
    """Invariant: mask-derived position ids make a padded row identical to the sequence alone."""
    model, tok = tiny
    pairs = [(fmt.prompt_ids("a much longer prompt here"), [10, 11]), (fmt.prompt_ids("short"), [12, 13, 14])]
    b = collate(pairs, tok.pad_token_id)
    assert b.response_mask[:, -2:].all() and b.n_response == 3
    with torch.no_grad():
        out = forward(model, b.attention_mask, input_ids=b.input_ids, logits_last=None)
        for i, (p, r) in enumerate(pairs):
            alone = collate([(p, r)], tok.pad_token_id)
            o1 = forward(model, alone.attention_mask, input_ids=alone.input_ids, logits_last=None)
            n = len(p) + len(r)
            # float32 sums in a different padding layout: 1e-5 covers reordering error
            torch.testing.assert_close(
                out.hidden_states[-1][i, -n:], o1.hidden_states[-1][0], atol=1e-5, rtol=1e-5
            )


def test_position_ids_skip_left_padding():
    m = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert position_ids(m).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]


def test_batched_generation_equals_one_at_a_time(tiny, fmt):
    model, tok = tiny
    prompts = [fmt.prompt_ids("first prompt, rather long"), fmt.prompt_ids("2nd")]
    batched = generate(model, tok, prompts, 6)
    single = [generate(model, tok, [p], 6)[0] for p in prompts]
    assert batched == single


def _hf_tokens(model, tok, prompts, n):
    """Reference: transformers' own ``generate``, one prompt at a time (no padding at all)."""
    out = []
    for p in prompts:
        ids = model.generate(input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id)[0, len(p) :]  # fmt: skip
        out.append(tok.decode(ids, skip_special_tokens=True))
    return out


def test_own_greedy_loop_equals_transformers_generate_with_an_end_token(tiny, fmt):
    """Per-prompt prefill + one batched decode gives transformers' greedy text, one prompt at a time, including rows
    that stop early: the end token is set to a token one row emits mid-way, so that row must stop there and the
    others continue (greedy argmax; a random model has no near-ties at float32 noise, so tokens match exactly)."""
    from reprlab.models.hf import ByteTokenizer

    model, _ = tiny
    prompts = [fmt.prompt_ids(t) for t in ("first prompt, rather long", "2nd", "a third one", "x y z")]
    from reprlab.methods.crl_safety.chat import _greedy

    tok = ByteTokenizer()
    free = _greedy(model, tok, prompts, 10, "cpu")  # [4, 10] token ids
    tok.eos_token_id = int(free[1, 3])  # the 4th new token of row 1 ends its reply
    got = _greedy(model, tok, prompts, 10, "cpu")
    assert (got[1, 4:] == tok.pad_token_id).all() and not torch.equal(got, free)  # the end token took effect
    assert generate(model, tok, prompts, 10, batch_size=4) == _hf_tokens(model, tok, prompts, 10)


def test_generation_config_with_logits_processors_goes_through_transformers(tiny, fmt, monkeypatch):
    """A repetition penalty changes greedy decoding; our loop would ignore it, so such models use model.generate."""
    from reprlab.methods.crl_safety import chat

    model, tok = tiny
    prompts = [fmt.prompt_ids("first prompt, rather long"), fmt.prompt_ids("2nd")]
    model.generation_config.repetition_penalty = 5.0
    try:
        calls = []
        monkeypatch.setattr(chat, "_greedy", lambda *a: calls.append(1))
        penalised = generate(model, tok, prompts, 8)
        assert not calls and penalised == _hf_tokens(model, tok, prompts, 8)
    finally:
        model.generation_config.repetition_penalty = 1.0


def test_memoised_ids_equal_fresh_tokenisation_and_are_private_copies(tiny):
    """Each text is tokenised once per ChatFormat; the ids equal a fresh object's and callers get their own lists."""
    _, tok = tiny
    calls = []

    class Counting(type(tok)):
        def encode(self, text, add_special_tokens=False):
            calls.append(text)
            return super().encode(text, add_special_tokens)

    fmt = ChatFormat(Counting(), None, max_prompt_tokens=8)
    first = (fmt.prompt_ids("a prompt longer than eight bytes"), fmt.response_ids("p", "Sure, here it is"),
             fmt.suffix_split("q"))  # fmt: skip
    n = len(calls)
    first[0].append(-1)  # a caller editing its list must not edit the memo
    again = (fmt.prompt_ids("a prompt longer than eight bytes"), fmt.response_ids("p", "Sure, here it is"),
             fmt.suffix_split("q"))  # fmt: skip
    assert len(calls) == n  # nothing tokenised twice
    fresh = ChatFormat(tok, None, max_prompt_tokens=8)
    assert again == (fresh.prompt_ids("a prompt longer than eight bytes"), fresh.response_ids("p", "Sure, here it is"),
                     fresh.suffix_split("q"))  # fmt: skip
    # the truncation and end-of-turn options still apply to the memoised reply
    assert fmt.response_ids("p", "Sure, here it is", end_turn=False, max_tokens=3) == fresh.response_ids(
        "p", "Sure, here it is", end_turn=False, max_tokens=3
    )


def test_generation_from_embeddings_equals_transformers_generate(tiny, fmt):
    """The embedding attack's decoding (each row's real positions prefilled alone) gives transformers' greedy text
    from the same left-padded embeddings, one row at a time."""
    from reprlab.methods.crl_safety.chat import generate_embeds

    model, tok = tiny
    b = collate(
        [(fmt.prompt_ids(t), []) for t in ("first prompt, rather long", "2nd", "third")], tok.pad_token_id
    )
    torch.manual_seed(1)
    emb = model.get_input_embeddings()(b.input_ids) + 0.3 * torch.randn(
        *b.input_ids.shape, 32
    )  # off-vocabulary rows
    got = generate_embeds(model, tok, emb, b.attention_mask, 8)
    want = []
    for r in range(3):
        keep = b.attention_mask[r].bool()
        with torch.no_grad():
            ids = model.generate(inputs_embeds=emb[r : r + 1, keep], attention_mask=torch.ones(1, int(keep.sum())),
                                 max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id,
                                 eos_token_id=tok.eos_token_id)[0]  # fmt: skip
        want.append(tok.decode(ids, skip_special_tokens=True))
    assert got == want
