"""User prompts the chat model writes itself, for a broader benign set [ours; docs/crl_safety.md, "Prompts the
model writes itself"].

The reference recipes keep benign behaviour with large, varied benign sets (circuit breakers: UltraChat; CRL:
WildGuardMix's benign prompts); offline we have 40 hand-written requests. An instruction-tuned model given its
chat template up to the start of a user turn, and nothing else, writes a plausible user request (the Magpie
recipe: Xu et al., 2024, "Magpie: Alignment Data Synthesis from Scratch by Prompting Aligned LLMs with
Nothing"). We sample such turns, keep the complete, new, distinct ones, and the recipe adds those the base model
then answers to the defences' benign sets.

Sampling uses its own ``torch.Generator``, so the global random state (and every other part of a run) is what it
would be without it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from reprlab.methods.crl_safety.chat import SUFFIX_SENTINEL, _cache_kw, _encode
from reprlab.methods.crl_safety.data import prompt_key


@dataclass(frozen=True)
class SelfPrompts:
    """What :func:`sample_user_prompts` kept, and why the rest was dropped.

    ``prompts``: the kept prompts, in sampling order; ``asked``: how many were asked for. ``sampled``: turns sampled
    in all, each either kept or counted once below: ``incomplete``, did not end within the token budget;
    ``short``, fewer than ``min_words`` words; ``duplicate``, a prompt already kept (up to case and whitespace);
    ``excluded``, in the caller's ``exclude`` set; ``surplus``, sampled in the last batch after enough were kept.
    """

    prompts: list[str]
    asked: int
    sampled: int = 0
    incomplete: int = 0
    short: int = 0
    duplicate: int = 0
    excluded: int = 0
    surplus: int = 0
    diagnostics: dict = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        """Whether as many prompts were kept as were asked for."""
        return len(self.prompts) >= self.asked


def user_turn_prefix(fmt) -> tuple[list[int], list[int]]:
    """``(prefix ids, end-of-turn ids)`` of ``fmt``'s chat template (a ``ChatFormat``): the rendered
    conversation up to where the user's words start (system message as ``fmt`` sends it), and the ids of what the
    template writes after them, trailing whitespace left out unless that is all it writes (ChatML's
    ``<|im_end|>``, Llama-3's ``<|eot_id|>``, Mistral's ``[/INST]``)."""
    text = fmt.tokenizer.apply_chat_template(fmt._messages(SUFFIX_SENTINEL, truncate=False), tokenize=False)
    pre, post = text.split(SUFFIX_SENTINEL)
    return _encode(fmt.tokenizer, pre), _encode(fmt.tokenizer, post.rstrip() or post)


def _end(row: list[int], stops: list[list[int]]) -> int | None:
    """Where the first of the ``stops`` sequences to occur in ``row`` starts, or None."""
    for i in range(len(row)):
        if any(row[i : i + len(seq)] == seq for seq in stops):
            return i
    return None


@torch.no_grad()
def _sample_turns(model, prefix: list[int], stops: list[list[int]], n: int, max_new_tokens: int,
                  temperature: float, gen: torch.Generator) -> list[tuple[list[int], bool]]:  # fmt: skip
    """``n`` sampled continuations of ``prefix`` (one batch, no padding: every row shares the prefix); each as
    ``(token ids before the first stop sequence, ended)``."""
    dev = next(model.parameters()).device
    kw = _cache_kw(model)
    out = model(input_ids=torch.tensor([prefix] * n, device=dev), use_cache=True, logits_to_keep=1)
    cache = getattr(out, "cache", None) or out.past_key_values
    rows: list[list[int]] = [[] for _ in range(n)]
    ended = [False] * n
    for t in range(max_new_tokens):
        probs = torch.softmax(out.logits[:, -1].float().cpu() / temperature, -1)
        nxt = torch.multinomial(probs, 1, generator=gen).squeeze(1)
        for i, x in enumerate(nxt.tolist()):
            rows[i].append(x)
            ended[i] = ended[i] or any(rows[i][-len(seq) :] == seq for seq in stops)
        if all(ended) or t == max_new_tokens - 1:
            break
        out = model(input_ids=nxt[:, None].to(dev), use_cache=True, logits_to_keep=1, **{kw: cache})
        cache = getattr(out, "cache", None) or out.past_key_values
    res = []
    for row in rows:
        cut = _end(row, stops)
        res.append((row if cut is None else row[:cut], cut is not None))
    return res


def sample_user_prompts(
    model,
    fmt,
    n: int,
    seed: int,
    max_new_tokens: int = 48,
    temperature: float = 1.0,
    min_words: int = 4,
    exclude: set[str] | frozenset[str] = frozenset(),
    batch_size: int = 32,
    max_batches: int | None = None,
) -> SelfPrompts:
    """Sample up to ``n`` user prompts from ``model`` through ``fmt`` (a ``ChatFormat``: its template and system
    message), in batches of ``batch_size`` until ``n`` are kept or ``max_batches`` batches are spent (None: enough
    for ``8 n`` turns, so a model that ends fewer than one turn in eight within the budget comes up short; read
    :attr:`SelfPrompts.complete`).

    A turn is kept when it ends with the template's end-of-turn sequence (or the tokenizer's end-of-sequence
    token) within ``max_new_tokens``, has at least ``min_words`` words, and is neither a prompt already kept nor in
    ``exclude`` (both compared up to case and whitespace: :func:`prompt_key`). Deterministic for a given model,
    ``seed`` and arguments on one machine.
    """
    tok = fmt.tokenizer
    prefix, end = user_turn_prefix(fmt)
    stops = [end] if end else []
    if tok.eos_token_id is not None:
        stops.append([int(tok.eos_token_id)])
    if not stops:
        raise ValueError(
            "the chat template writes nothing after a user turn and the tokenizer has no eos token"
        )
    if max_batches is None:
        max_batches = max(1, -(-8 * n // batch_size))
    gen = torch.Generator().manual_seed(seed)
    excl = {prompt_key(p) for p in exclude}
    kept, seen = [], set()
    c = dict(sampled=0, incomplete=0, short=0, duplicate=0, excluded=0, surplus=0)
    batches = 0
    while batches < max_batches and len(kept) < n:
        batches += 1
        for ids, ended in _sample_turns(model, prefix, stops, batch_size, max_new_tokens, temperature, gen):
            c["sampled"] += 1
            text = tok.decode(ids, skip_special_tokens=True).strip()
            key = prompt_key(text)
            if len(kept) >= n:
                c["surplus"] += 1
            elif not ended:
                c["incomplete"] += 1
            elif len(text.split()) < min_words:
                c["short"] += 1
            elif key in seen:
                c["duplicate"] += 1
            elif key in excl:
                c["excluded"] += 1
            else:
                seen.add(key)
                kept.append(text)
    return SelfPrompts(kept, n, **c, diagnostics={"batches": batches, "max_batches": max_batches})
