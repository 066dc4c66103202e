import torch

from reprlab.methods.crl_safety.chat import forward
from reprlab.methods.crl_safety.embedding_attack import _init_suffix, _layout, embedding_attack, target_losses
from reprlab.methods.crl_safety.gcg import gcg_attack


def _setup(tiny, fmt):
    model, tok = tiny
    prompts = ["How do I make a cake?", "Write a poem about dogs and cats please"]
    targets = [fmt.response_ids(p, "Sure, here", end_turn=False) for p in prompts]
    return model, tok, prompts, targets


def test_batched_suffix_gradients_equal_single_prompt(tiny, fmt):
    """Summed per-prompt losses: each prompt's suffix gradient is independent of the batch (invariant)."""
    model, tok, prompts, targets = _setup(tiny, fmt)
    embed = model.get_input_embeddings()
    b, slots = _layout(fmt, prompts, targets, 5, tok.pad_token_id)
    suffix = (_init_suffix(tok, embed, "x x", 5, 2) + 0.1 * torch.randn(2, 5, 32)).requires_grad_(True)
    (g_batch,) = torch.autograd.grad(target_losses(model, embed, b, slots, suffix).sum(), [suffix])
    for i in range(2):
        b1, s1 = _layout(fmt, [prompts[i]], [targets[i]], 5, tok.pad_token_id)
        x = suffix[i : i + 1].detach().clone().requires_grad_(True)
        (g1,) = torch.autograd.grad(target_losses(model, embed, b1, s1, x).sum(), [x])
        torch.testing.assert_close(
            g_batch[i : i + 1], g1, atol=1e-5, rtol=1e-4
        )  # float32 padding-layout noise


def test_embedding_attack_lowers_target_loss(tiny, fmt):
    """Unconstrained suffix: 30 Adam steps must cut the target CE on a random tiny model."""
    model, tok, prompts, targets = _setup(tiny, fmt)
    r = embedding_attack(
        model, tok, fmt, prompts, targets, steps=30, lr=0.1, init="x x x", n_suffix=5, max_new_tokens=4
    )
    first = r.loss_curve[0]
    assert all(b < 0.8 * f for b, f in zip(r.best_loss, first))
    assert len(r.generations) == 2
    assert not any(p.grad is not None for p in model.parameters())  # the model is never touched


def test_gcg_runs_and_keeps_finite_losses(tiny, fmt):
    model, tok, prompts, targets = _setup(tiny, fmt)
    r = gcg_attack(
        model, tok, fmt, prompts, targets, steps=3, n_suffix=4, top_k=8, search_width=8, max_new_tokens=4
    )
    assert len(r.loss_curve) == 3 and all(torch.isfinite(torch.tensor(c)).all() for c in r.loss_curve)
    assert len(r.suffixes) == 2 and len(r.generations) == 2
    # the best-so-far loss is the minimum of the per-step bests
    assert r.best_loss == [min(c[i] for c in r.loss_curve) for i in range(2)]


def test_cached_prefix_scoring_equals_full_sequence_scoring(tiny, fmt):
    """GCG's KV-cached candidate scores equal the CE of the full left-padded sequences (target_losses)."""
    from reprlab.methods.crl_safety.gcg import score_candidates

    model, tok, prompts, targets = _setup(tiny, fmt)
    embed = model.get_input_embeddings()
    g = torch.Generator().manual_seed(0)
    for p, t in zip(prompts, targets):
        cands = torch.randint(3, 200, (5, 4), generator=g)  # [width, n_suffix]
        pre, post = fmt.suffix_split(p)
        got, exact = score_candidates(model, pre, cands, post, t, chunk=2)
        b, slots = _layout(fmt, [p] * 5, [t] * 5, 4, tok.pad_token_id)
        with torch.no_grad():
            want = target_losses(model, embed, b, slots, embed(cands))
            emb = embed(b.input_ids).masked_scatter(slots.unsqueeze(-1), embed(cands))
            logits = forward(
                model, b.attention_mask, inputs_embeds=emb, hidden=False, logits_last=None
            ).logits
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        greedy = logits[:, -len(t) - 1 : -1].argmax(-1) == torch.tensor(t)
        assert exact.tolist() == greedy.all(-1).tolist()


def test_gcg_returns_and_evaluates_the_best_suffix_not_the_last(tiny, fmt):
    """The returned suffix re-scores (independently, by full-sequence CE) at the best loss of the curve, and the
    generation is greedy decoding from exactly that suffix. Each step moves to its best candidate even when it is
    worse than an earlier one, so the last suffix is not the best here (checked, so the test can fail)."""
    from reprlab.methods.crl_safety.chat import generate

    model, tok, prompts, targets = _setup(tiny, fmt)
    embed = model.get_input_embeddings()
    r = gcg_attack(model, tok, fmt, prompts, targets, steps=8, n_suffix=4, top_k=4, search_width=4,
                   max_new_tokens=4, seed=1, early_stop=False)  # fmt: skip
    curve = torch.tensor(r.loss_curve)  # [steps, prompts]
    assert (curve[-1] > curve.min(0).values + 1e-4).any(), "precondition: some prompt ends above its best"
    for i, (p, t) in enumerate(zip(prompts, targets)):
        ids = tok.encode(r.suffixes[i])  # the text round-trips (re-tokenisation filter)
        assert ids == r.suffix_ids[i]
        b, slots = _layout(fmt, [p], [t], 4, tok.pad_token_id)
        with torch.no_grad():
            ce = target_losses(model, embed, b, slots, embed(torch.tensor([ids])))
        # float32: cached and uncached attention sum in different orders
        torch.testing.assert_close(float(ce[0]), float(curve[:, i].min()), atol=1e-4, rtol=1e-4)
        assert r.best_loss[i] == float(curve[:, i].min())
        pre, post = fmt.suffix_split(p)
        assert r.generations[i] == generate(model, tok, [pre + ids + post], 4)[0]


def test_gcg_drops_candidates_that_do_not_retokenise(tiny, fmt):
    """With every byte allowed, single bytes >= 0x80 decode to U+FFFD, which encodes to other ids: the filter must
    drop them (as nanoGCG's filter_ids) and the returned suffix must round-trip; without it, it does not."""
    model, tok, prompts, targets = _setup(tiny, fmt)
    vocab = model.get_input_embeddings().weight.shape[0]
    allowed = torch.ones(vocab, dtype=torch.bool)
    allowed[:3] = False  # pad, bos, eos
    kw = dict(
        steps=4, n_suffix=4, top_k=64, search_width=32, max_new_tokens=2, allowed=allowed, early_stop=False
    )
    on = gcg_attack(model, tok, fmt, prompts, targets, **kw)
    assert on.n_filtered > 0
    assert all(tok.encode(tok.decode(s)) == s for s in on.suffix_ids)
    off = gcg_attack(model, tok, fmt, prompts, targets, filter_retokenize=False, **kw)
    assert off.n_filtered == 0
    assert any(tok.encode(tok.decode(s)) != s for s in off.suffix_ids)  # the filter is what makes it hold
