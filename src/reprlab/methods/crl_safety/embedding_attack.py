"""Input-embedding suffix attack, batched across prompts [known: Circuit Breakers eval ``softopt.py``;
Schwinn & Geisler's stronger variant].

A continuous suffix of ``n_suffix`` vectors is inserted at the end of the user turn and optimised with Adam
to minimise the cross-entropy of an affirmative target reply. It is **unconstrained** (no ε-ball), as in
the Circuit Breakers evaluation. Several configs (learning rate, initial string) run one after another; a prompt counts as
broken if any config's greedy generation is judged *comply* [ours: the aggregation is unknown].

Batching: every prompt owns its suffix ``[batch, n_suffix, d_model]``; the loss is the *sum* of per-prompt
mean CEs, so each prompt's gradient equals the one it would get alone (tested), while one forward pass
serves the whole batch. The best suffix per prompt (lowest CE seen) is kept; the official code stops early
at CE 0.05, which the best-so-far rule subsumes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from reprlab.methods.crl_safety.chat import ChatFormat, collate, forward, generate_embeds, response_logits
from reprlab.train.timing import section


@dataclass
class EmbeddingAttackResult:
    """Per prompt: best CE ``[n]``, CE after every step ``[steps, n]`` and the generations after the attack."""

    best_loss: list[float]
    loss_curve: list[list[float]]
    generations: list[str]
    lr: float
    init: str


def _layout(fmt: ChatFormat, prompts: list[str], targets: list[list[int]], n_suffix: int, pad_id: int):
    """Left-padded ids with ``n_suffix`` placeholder slots and the mask of those slots."""
    pairs, pre_len = [], []
    for p, t in zip(prompts, targets, strict=True):
        pre, post = fmt.suffix_split(p)
        pairs.append((pre + [pad_id] * n_suffix + post, list(t)))
        pre_len.append(len(pre))
    batch = collate(pairs, pad_id)
    width = batch.input_ids.shape[1]
    slots = torch.zeros_like(batch.response_mask)
    for i, (p, t) in enumerate(pairs):
        start = width - len(p) - len(t) + pre_len[i]
        slots[i, start : start + n_suffix] = True
    return batch, slots


def _init_suffix(tok, embed: torch.nn.Embedding, init: str, n: int, batch: int) -> Tensor:
    ids = list(tok.encode(init, add_special_tokens=False)) or [0]
    ids = (ids * (n // len(ids) + 1))[:n]  # repeat or truncate the string to n tokens
    vec = embed.weight[torch.tensor(ids, device=embed.weight.device)].detach()
    return vec.unsqueeze(0).repeat(batch, 1, 1).clone()  # [batch, n_suffix, d_model]


def target_losses(model, embed_fn, batch, slots: Tensor, suffix: Tensor) -> Tensor:
    """Per-prompt mean target CE ``[batch]`` with ``suffix`` ``[batch, n_suffix, d_model]`` in the slots."""
    emb = embed_fn(batch.input_ids)
    emb = emb.masked_scatter(slots.unsqueeze(-1), suffix.to(emb.dtype))
    out = forward(
        model, batch.attention_mask, inputs_embeds=emb, hidden=False, logits_last=batch.n_response + 1
    )
    logits, tgt, mask = response_logits(out.logits, batch)
    ce = F.cross_entropy(logits.float().transpose(1, 2), tgt, reduction="none")  # [batch, n_response]
    return (ce * mask).sum(-1) / mask.sum(-1).clamp(min=1)


def embedding_attack(model, tok, fmt: ChatFormat, prompts: list[str], targets: list[list[int]], steps: int,
                     lr: float, init: str, n_suffix: int = 20, max_new_tokens: int = 32) -> EmbeddingAttackResult:  # fmt: skip
    """Optimise one suffix per prompt (batched) and generate from the best suffix.

    Args:
        targets: token ids of each prompt's affirmative target reply.
    """
    if not prompts:
        raise ValueError("embedding attack needs at least one prompt")
    dev = next(model.parameters()).device
    embed = model.get_input_embeddings()
    batch, slots = _layout(fmt, prompts, targets, n_suffix, tok.pad_token_id)
    batch, slots = batch.to(dev), slots.to(dev)
    suffix = _init_suffix(tok, embed, init, n_suffix, len(prompts)).requires_grad_(True)
    opt = torch.optim.Adam([suffix], lr=lr)
    best = torch.full((len(prompts),), float("inf"), device=dev)
    best_suffix = suffix.detach().clone()
    curve = []
    was_training = model.training
    model.eval()
    for _ in range(steps):
        losses = target_losses(model, embed, batch, slots, suffix)
        better = losses.detach() < best
        best = torch.where(better, losses.detach(), best)
        best_suffix[better] = suffix.detach()[better]
        curve.append(losses.detach().tolist())
        (grad,) = torch.autograd.grad(losses.sum(), [suffix])  # only the suffix: no grads into the model
        suffix.grad = grad
        opt.step()
        opt.zero_grad(set_to_none=True)
    with torch.no_grad():  # score the final suffix too
        losses = target_losses(model, embed, batch, slots, suffix)
        better = losses < best
        best = torch.where(better, losses, best)
        best_suffix[better] = suffix.detach()[better]
        gen_batch, gen_slots = _layout(fmt, prompts, [[] for _ in prompts], n_suffix, tok.pad_token_id)
        gen_batch, gen_slots = gen_batch.to(dev), gen_slots.to(dev)
        emb = embed(gen_batch.input_ids).masked_scatter(gen_slots.unsqueeze(-1), best_suffix)
        with section("generate"):
            gens = generate_embeds(model, tok, emb, gen_batch.attention_mask, max_new_tokens)
    model.train(was_training)
    return EmbeddingAttackResult(best.tolist(), curve, gens, lr, init)
