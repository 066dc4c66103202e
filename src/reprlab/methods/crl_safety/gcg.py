"""A small GCG (Zou et al. 2023, arXiv 2307.15043), batched across prompts [known algorithm; sizes ours].

Each step, per prompt: the gradient of the target CE w.r.t. the one-hot suffix gives the ``top_k`` most
promising tokens per position; ``search_width`` random single-token swaps are scored exactly and the best
candidate is kept. All prompts' candidates are scored in shared forward passes. Tokens are restricted to
ASCII-printable, non-special vocabulary entries [ours]; no re-tokenisation filter [ours: simplification].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from reprlab.methods.crl_safety.chat import ChatFormat, generate
from reprlab.methods.crl_safety.embedding_attack import _layout, target_losses


@dataclass
class GCGResult:
    best_loss: list[float]
    loss_curve: list[list[float]]
    suffixes: list[str]
    generations: list[str]


def allowed_tokens(tok, vocab_size: int) -> torch.Tensor:
    """Bool mask ``[d_vocab]`` of ASCII-printable, non-special tokens."""
    special = set(getattr(tok, "all_special_ids", []) or []) | {tok.pad_token_id, tok.eos_token_id}
    ok = torch.zeros(vocab_size, dtype=torch.bool)
    for i in range(vocab_size):
        if i in special:
            continue
        s = tok.decode([i])
        ok[i] = bool(s) and s.isascii() and s.isprintable()
    return ok


def gcg_attack(model, tok, fmt: ChatFormat, prompts: list[str], targets: list[list[int]], steps: int, n_suffix: int = 10,
               top_k: int = 64, search_width: int = 32, init_token: str = " x", max_new_tokens: int = 32,
               allowed: torch.Tensor | None = None, seed: int = 0, chunk: int = 64) -> GCGResult:  # fmt: skip
    dev = next(model.parameters()).device
    embed = model.get_input_embeddings()
    vocab = embed.weight.shape[0]
    allowed = (allowed if allowed is not None else allowed_tokens(tok, vocab)).to(dev)
    init_ids = list(tok.encode(init_token, add_special_tokens=False))[:1] or [0]
    n = len(prompts)
    suffix = torch.tensor(init_ids * n_suffix, device=dev).repeat(n, 1)  # [batch, n_suffix]
    batch, slots = _layout(fmt, prompts, targets, n_suffix, tok.pad_token_id)
    batch, slots = batch.to(dev), slots.to(dev)
    gen = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.eval()
    curve, best = [], torch.full((n,), float("inf"))
    for _ in range(steps):
        onehot = F.one_hot(suffix, vocab).to(embed.weight.dtype).requires_grad_(True)  # [batch, n_suffix, d_vocab]
        losses = target_losses(model, embed, batch, slots, onehot @ embed.weight)
        (grad,) = torch.autograd.grad(losses.sum(), [onehot])
        grad = grad.masked_fill(~allowed, float("inf"))
        top = (-grad).topk(top_k, dim=-1).indices  # [batch, n_suffix, top_k]
        pos = torch.randint(n_suffix, (n, search_width), generator=gen).to(dev)
        pick = torch.randint(top_k, (n, search_width), generator=gen).to(dev)
        cands = suffix.unsqueeze(1).repeat(1, search_width, 1)  # [batch, width, n_suffix]
        new_tok = top[torch.arange(n, device=dev)[:, None], pos, pick]
        cands.scatter_(2, pos.unsqueeze(-1), new_tok.unsqueeze(-1))
        # score all candidates of all prompts: row r*width + w uses prompt r's layout
        flat = cands.reshape(n * search_width, n_suffix)
        rep = torch.arange(n, device=dev).repeat_interleave(search_width)
        scores = []
        with torch.no_grad():
            for s in range(0, flat.shape[0], chunk):
                r = rep[s : s + chunk]
                sub = type(batch)(batch.input_ids[r], batch.attention_mask[r], batch.response_mask[r], batch.n_response)
                scores.append(target_losses(model, embed, sub, slots[r], embed(flat[s : s + chunk])))
        scores = torch.cat(scores).view(n, search_width)
        idx = scores.argmin(-1)
        suffix = cands[torch.arange(n, device=dev), idx]
        step_best = scores.min(-1).values.cpu()
        best = torch.minimum(best, step_best)
        curve.append(step_best.tolist())
    texts = [tok.decode(s.tolist(), skip_special_tokens=True) for s in suffix]
    # generate from discrete ids: pre + suffix + post exactly as optimised (no re-tokenisation)
    ids = []
    for p, s in zip(prompts, suffix.tolist()):
        pre, post = fmt.suffix_split(p)
        ids.append(pre + s + post)
    gens = generate(model, tok, ids, max_new_tokens)
    model.train(was_training)
    return GCGResult(best.tolist(), curve, texts, gens)
