"""A small GCG (Zou et al. 2023, arXiv 2307.15043), batched across prompts [known algorithm; sizes ours].

Each step, per prompt: the gradient of the target CE w.r.t. the one-hot suffix gives the ``top_k`` most
promising tokens per position; ``search_width`` random single-token swaps are scored exactly and the best
candidate becomes the next suffix (as in Zou et al.). All prompts' candidates are scored in shared forward passes.
Tokens are restricted to ASCII-printable, non-special vocabulary entries [ours]. As nanoGCG does, candidates whose
decoded text does not re-tokenise to the same ids are dropped (``filter_retokenize``), so the returned string is
the suffix that was scored, and the attack returns and evaluates the *best* suffix found over all steps (lowest
target CE, nanoGCG's ``best_string``), not the last one.

Candidate scoring reuses each prompt's prefix (template + prompt, the tokens before the suffix) as a KV cache,
so a candidate's forward pass covers only suffix + template tail + target: on SmolLM2 with 30-token prompts
that is about a quarter of the tokens (the trick nanoGCG also uses). Tested equal to uncached scoring.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from reprlab.methods.crl_safety.chat import ChatFormat, _cache_kw, generate
from reprlab.methods.crl_safety.embedding_attack import _layout, target_losses
from reprlab.train.timing import section


@dataclass
class GCGResult:
    """Per prompt: the lowest target CE found, its suffix (text and ids) and the generation from it."""

    best_loss: list[float]
    loss_curve: list[list[float]]
    suffixes: list[str]
    generations: list[str]
    suffix_ids: list[list[int]] | None = None
    n_filtered: int = 0  # candidates dropped because they do not re-tokenise to themselves


def retokenizes(tok, cands: torch.Tensor) -> torch.Tensor:
    """Bool ``[width]``: ``encode(decode(c)) == c`` for each candidate row of ``cands [width, n_suffix]``."""
    out = []
    for row in cands.tolist():
        text = tok.decode(row, skip_special_tokens=False)
        out.append(list(tok.encode(text, add_special_tokens=False)) == row)
    return torch.tensor(out, dtype=torch.bool, device=cands.device)


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


@torch.no_grad()
def score_candidates(model, prefix_ids: list[int], cands: torch.Tensor, post_ids: list[int], target_ids: list[int],
                     chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Mean target CE of each candidate suffix of one prompt, with the prefix computed once as a KV cache.

    Args:
        cands: ``[width, n_suffix]`` suffix token ids.

    Returns:
        ``(ce [width], exact [width])``: CE of ``target_ids`` after ``prefix + cand + post``, and whether greedy
        decoding would emit the whole target (argmax match at every target position).
    """
    if not target_ids or not prefix_ids:
        raise ValueError(
            f"GCG scoring needs a non-empty prefix and target ({len(prefix_ids)}, {len(target_ids)} tokens)"
        )
    dev = cands.device
    pre = torch.tensor([prefix_ids], device=dev)
    cache_kw = _cache_kw(model)  # the keyword this transformers version (and peft's wrapper) takes
    cache = _cache_of(model(input_ids=pre, use_cache=True, logits_to_keep=1))  # only its KV cache is read
    n_pre, n_t = len(prefix_ids), len(target_ids)
    tail = torch.tensor(post_ids + target_ids, device=dev)
    tgt = torch.tensor(target_ids, device=dev)
    out, exact = [], []
    for s in range(0, cands.shape[0], chunk):
        c = cands[s : s + chunk]
        ids = torch.cat([c, tail.expand(c.shape[0], -1)], 1)  # [c, n_suffix + len(post) + n_target]
        kv = copy.deepcopy(cache)
        kv.batch_repeat_interleave(c.shape[0])
        pos = torch.arange(n_pre, n_pre + ids.shape[1], device=dev).expand(c.shape[0], -1)
        mask = torch.ones(c.shape[0], n_pre + ids.shape[1], dtype=torch.long, device=dev)
        logits = model(input_ids=ids, **{cache_kw: kv}, attention_mask=mask, position_ids=pos, use_cache=True,
                       logits_to_keep=n_t + 1).logits[:, :-1]  # fmt: skip
        ce = F.cross_entropy(logits.float().transpose(1, 2), tgt.expand(c.shape[0], -1), reduction="none")
        out.append(ce.mean(-1))
        exact.append((logits.argmax(-1) == tgt).all(-1))
    return torch.cat(out), torch.cat(exact)


def _cache_of(out):
    return getattr(out, "cache", None) or out.past_key_values


def gcg_attack(model, tok, fmt: ChatFormat, prompts: list[str], targets: list[list[int]], steps: int, n_suffix: int = 10,
               top_k: int = 64, search_width: int = 32, init_token: str = " x", max_new_tokens: int = 32,
               allowed: torch.Tensor | None = None, seed: int = 0, chunk: int = 64,
               early_stop: bool = True, filter_retokenize: bool = True) -> GCGResult:  # fmt: skip
    """Run GCG on each prompt toward its target ids; see the module docstring.

    Args:
        targets: per prompt, the target token ids of the reply.
        filter_retokenize: drop candidates that do not survive decode -> encode (nanoGCG's ``filter_ids``).
    """
    dev = next(model.parameters()).device
    embed = model.get_input_embeddings()
    vocab = embed.weight.shape[0]
    allowed = (allowed if allowed is not None else allowed_tokens(tok, vocab)).to(dev)
    init_ids = list(tok.encode(init_token, add_special_tokens=False))[:1] or [0]
    n = len(prompts)
    suffix = torch.tensor(init_ids * n_suffix, device=dev).repeat(n, 1)  # [batch, n_suffix]
    batch, slots = _layout(fmt, prompts, targets, n_suffix, tok.pad_token_id)
    batch, slots = batch.to(dev), slots.to(dev)
    splits = [fmt.suffix_split(p) for p in prompts]
    gen = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.eval()
    curve, best = [], torch.full((n,), float("inf"))
    best_suffix = suffix.clone()  # the lowest-CE suffix so far, per prompt (returned and evaluated)
    n_filtered = 0
    done = torch.zeros(
        n, dtype=torch.bool
    )  # prompts whose suffix already makes greedy decoding emit the target
    for _ in range(steps):
        onehot = (
            F.one_hot(suffix, vocab).to(embed.weight.dtype).requires_grad_(True)
        )  # [batch, n_suffix, d_vocab]
        with section("gradient"):
            losses = target_losses(model, embed, batch, slots, onehot @ embed.weight)
            (grad,) = torch.autograd.grad(losses.sum(), [onehot])
        grad = grad.masked_fill(~allowed, float("inf"))
        top = (-grad).topk(top_k, dim=-1).indices  # [batch, n_suffix, top_k]
        pos = torch.randint(n_suffix, (n, search_width), generator=gen).to(dev)
        pick = torch.randint(top_k, (n, search_width), generator=gen).to(dev)
        cands = suffix.unsqueeze(1).repeat(1, search_width, 1)  # [batch, width, n_suffix]
        new_tok = top[torch.arange(n, device=dev)[:, None], pos, pick]
        cands.scatter_(2, pos.unsqueeze(-1), new_tok.unsqueeze(-1))
        step_best = best.clone()
        for r in range(n):  # one cached prefix per prompt; its candidates share it
            if done[r]:
                continue
            pre, post = splits[r]
            cand = cands[r]
            if filter_retokenize:
                with section("retokenise filter"):
                    keep = retokenizes(tok, cand)
                n_filtered += int((~keep).sum())
                if not bool(keep.any()):  # nothing survives: keep this prompt's suffix for the step
                    continue
                cand = cand[keep]
            with section("score candidates"):
                sc, ex = score_candidates(model, pre, cand, post, list(targets[r]), chunk)
            i = int(sc.argmin())
            suffix[r], step_best[r], done[r] = cand[i], float(sc[i]), bool(ex[i])
            if float(sc[i]) < float(best[r]):
                best[r], best_suffix[r] = float(sc[i]), cand[i]
        curve.append(step_best.tolist())
        if early_stop and bool(done.all()):  # as nanoGCG: stop once every target is matched exactly
            break
    texts = [tok.decode(s.tolist(), skip_special_tokens=True) for s in best_suffix]
    # generate from discrete ids: pre + best suffix + post exactly as scored
    ids = [pre + s + post for (pre, post), s in zip(splits, best_suffix.tolist())]
    with section("generate"):
        gens = generate(model, tok, ids, max_new_tokens)
    model.train(was_training)
    return GCGResult(best.tolist(), curve, texts, gens, best_suffix.tolist(), n_filtered)
