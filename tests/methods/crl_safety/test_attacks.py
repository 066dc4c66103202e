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
        torch.testing.assert_close(g_batch[i : i + 1], g1, atol=1e-5, rtol=1e-4)  # float32 padding-layout noise


def test_embedding_attack_lowers_target_loss(tiny, fmt):
    """Unconstrained suffix: 30 Adam steps must cut the target CE on a random tiny model."""
    model, tok, prompts, targets = _setup(tiny, fmt)
    r = embedding_attack(model, tok, fmt, prompts, targets, steps=30, lr=0.1, init="x x x", n_suffix=5, max_new_tokens=4)
    first = r.loss_curve[0]
    assert all(b < 0.8 * f for b, f in zip(r.best_loss, first))
    assert len(r.generations) == 2
    assert not any(p.grad is not None for p in model.parameters())  # the model is never touched


def test_gcg_runs_and_keeps_finite_losses(tiny, fmt):
    model, tok, prompts, targets = _setup(tiny, fmt)
    r = gcg_attack(model, tok, fmt, prompts, targets, steps=3, n_suffix=4, top_k=8, search_width=8, max_new_tokens=4)
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
            logits = forward(model, b.attention_mask, inputs_embeds=emb, hidden=False, logits_last=None).logits
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        greedy = logits[:, -len(t) - 1 : -1].argmax(-1) == torch.tensor(t)
        assert exact.tolist() == greedy.all(-1).tolist()

