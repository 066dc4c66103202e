"""Chat formatting, left-padded batches and the forward/generate helpers every stage shares.

Chat templates are applied the model's way: we render ``apply_chat_template(..., tokenize=False)`` and
tokenise the rendered text without adding special tokens (the template already carries them).

Default system prompt [ours, documented]: ``system_prompt=None`` keeps whatever the template does when no
system message is given. SmolLM2's GGUF template then injects "You are a helpful AI assistant named
SmolLM, trained by Hugging Face"; Llama-3-Instruct's injects nothing. A string (possibly empty) is sent as an
explicit system message instead; ``crl-tiny`` uses ``""`` to save ~15 tokens per sequence on the CPU.

All batches are LEFT padded and every forward pass receives ``position_ids`` computed from the attention
mask, so a padded row gives the same hidden states as the unpadded sequence (tested), and all responses end
in the last column, which lets us compute logits only for the last ``max_response + 1`` positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from reprlab.train.timing import section

SUFFIX_SENTINEL = "\x00SUFFIX\x00"


def _encode(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


@dataclass(frozen=True)
class ChatFormat:
    """Render prompts/responses with the tokenizer's chat template.

    Args:
        tokenizer: HF tokenizer (or ``reprlab.models.hf.ByteTokenizer``) with a chat template.
        system_prompt: None keeps the template's default; a string is sent as the system message.
        max_prompt_tokens: user prompts are truncated to this many tokens of *content* [ours], to bound cost.

    Each prompt (and prompt + reply) is rendered and tokenised once: the ids are kept per text, keyed on the text
    itself, so every model, attack and stage of a run reuses them (the template, tokenizer and truncation are
    this object's own, fixed fields). Callers get fresh lists.
    """

    tokenizer: object
    system_prompt: str | None = None
    max_prompt_tokens: int = 64
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def _messages(self, prompt: str, response: str | None = None, truncate: bool = True) -> list[dict]:
        msgs = [] if self.system_prompt is None else [{"role": "system", "content": self.system_prompt}]
        msgs.append({"role": "user", "content": self._truncate(prompt) if truncate else prompt})
        if response is not None:
            msgs.append({"role": "assistant", "content": response})
        return msgs

    def _truncate(self, prompt: str) -> str:
        ids = _encode(self.tokenizer, prompt)
        if len(ids) <= self.max_prompt_tokens:
            return prompt
        return self.tokenizer.decode(ids[: self.max_prompt_tokens], skip_special_tokens=True)

    def render_prompt(self, prompt: str) -> str:
        """Text up to and including the assistant header."""
        return self.tokenizer.apply_chat_template(
            self._messages(prompt), add_generation_prompt=True, tokenize=False
        )

    def _once(self, key: tuple, make):
        hit = self._memo.get(key)
        if hit is None:
            with section("tokenise"):
                hit = self._memo[key] = make()
        return hit

    def prompt_ids(self, prompt: str) -> list[int]:
        return list(
            self._once(("prompt", prompt), lambda: _encode(self.tokenizer, self.render_prompt(prompt)))
        )

    def response_ids(
        self, prompt: str, response: str, end_turn: bool = True, max_tokens: int | None = None
    ) -> list[int]:
        """Token ids of the assistant reply as the template writes it.

        Args:
            end_turn: append the template's end-of-turn marker (complete replies, e.g. refusals); False for
                truncated generations, which must not be taught to stop mid-sentence.
            max_tokens: truncate the reply content to this many tokens (before the end-of-turn marker).
        """
        content, marker = self._once(
            ("response", prompt, response), lambda: self._reply_parts(prompt, response)
        )
        if max_tokens is not None:
            content = content[:max_tokens]
        return list(content) + (list(marker) if end_turn else [])

    def _reply_parts(self, prompt: str, response: str) -> tuple[list[int], list[int]]:
        """``(content ids, end-of-turn marker ids)`` of the whole reply."""
        head = self.render_prompt(prompt)
        full = self.tokenizer.apply_chat_template(self._messages(prompt, response), tokenize=False)
        tail = full[len(head) :] if full.startswith(head) else response
        # the reply content is the rendered tail's prefix; what follows it is the end-of-turn marker
        cut = tail.find(response) + len(response) if response and response in tail else len(tail)
        return _encode(self.tokenizer, tail[:cut]), _encode(self.tokenizer, tail[cut:])

    def suffix_split(self, prompt: str) -> tuple[list[int], list[int]]:
        """``(pre, post)`` ids around an adversarial suffix slot at the end of the user content."""
        pre, post = self._once(("suffix", prompt), lambda: self._suffix_parts(prompt))
        return list(pre), list(post)

    def _suffix_parts(self, prompt: str) -> tuple[list[int], list[int]]:
        text = self.tokenizer.apply_chat_template(
            self._messages(self._truncate(prompt) + SUFFIX_SENTINEL, truncate=False),
            add_generation_prompt=True,
            tokenize=False,
        )
        pre, post = text.split(SUFFIX_SENTINEL)
        return _encode(self.tokenizer, pre), _encode(self.tokenizer, post)


@dataclass
class Batch:
    """Left-padded prompt+response batch.

    Attributes:
        input_ids: ``[batch, pos]`` token ids.
        attention_mask: ``[batch, pos]`` 1 for real tokens.
        response_mask: ``[batch, pos]`` bool, True on response tokens (all end in the last column).
        n_response: width of the response block (``max`` response length in the batch).
    """

    input_ids: Tensor
    attention_mask: Tensor
    response_mask: Tensor
    n_response: int

    def to(self, device) -> Batch:
        return Batch(self.input_ids.to(device), self.attention_mask.to(device), self.response_mask.to(device),
                     self.n_response)  # fmt: skip


def collate(pairs: Sequence[tuple[list[int], list[int]]], pad_id: int) -> Batch:
    """Left-pad ``(prompt_ids, response_ids)`` pairs into one :class:`Batch`."""
    if not pairs:
        raise ValueError("collate got an empty list of sequences")
    width = max(len(p) + len(r) for p, r in pairs)
    ids = torch.full((len(pairs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(pairs), width), dtype=torch.long)
    resp = torch.zeros((len(pairs), width), dtype=torch.bool)
    for i, (p, r) in enumerate(pairs):
        seq = p + r
        ids[i, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
        mask[i, width - len(seq) :] = 1
        if r:
            resp[i, width - len(r) :] = True
    return Batch(ids, mask, resp, max(len(r) for _, r in pairs))


def position_ids(attention_mask: Tensor) -> Tensor:
    """``[batch, pos]`` positions counting only real tokens, so left padding does not shift them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def forward(model, attention_mask: Tensor, input_ids: Tensor | None = None, inputs_embeds: Tensor | None = None,
            hidden: bool = True, logits_last: int | None = 0):  # fmt: skip
    """One forward pass with mask-derived positions.

    Args:
        logits_last: compute logits only for the last ``k`` positions (0 = none needed is not supported by
            HF, so 0 means 1 to keep the call cheap; None = all positions).

    Returns:
        the HF output (``hidden_states``: tuple of ``n_layers + 1`` tensors ``[batch, pos, d_model]``).
    """
    kwargs = {} if logits_last is None else {"logits_to_keep": max(int(logits_last), 1)}
    return model(input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                 position_ids=position_ids(attention_mask), output_hidden_states=hidden, use_cache=False, **kwargs)  # fmt: skip


def response_logits(out_logits: Tensor, batch: Batch) -> tuple[Tensor, Tensor, Tensor]:
    """Logits predicting each response token.

    Args:
        out_logits: ``[batch, k, d_vocab]`` logits of the last ``k >= n_response + 1`` positions.

    Returns:
        ``(logits [batch, n_response, d_vocab], targets [batch, n_response], mask [batch, n_response])``.
    """
    r = batch.n_response
    logits = out_logits[:, -r - 1 : -1]  # position t predicts token t + 1
    return logits, batch.input_ids[:, -r:], batch.response_mask[:, -r:]


@torch.inference_mode()
def generate(
    model, tokenizer, prompt_ids: Sequence[list[int]], max_new_tokens: int, batch_size: int = 16
) -> list[str]:
    """Greedy generation, batched over prompts with a KV cache; returns the decoded new text per prompt.

    Each prompt of a batch is prefilled alone (no padding: prompts of 13 to 47 tokens wasted 35-42 % of a padded
    prefill, most of generation's cost on CPU), the row caches are left-padded into one, and every new token is decoded
    for the whole batch in one step, with mask-derived positions, as ``model.generate`` decodes. A row that emits the
    end-of-sequence token gets padding after it; the batch stops when every row has. Models whose generation config
    adds logits processors to greedy decoding (a repetition penalty, banned n-grams...) or whose cache layers are
    not plain dynamic layers go through ``model.generate`` on a left-padded batch instead.
    """
    dev = next(model.parameters()).device
    if not prompt_ids:
        return []
    texts: list[str] = []
    own = _plain_greedy(model)
    for s in range(0, len(prompt_ids), batch_size):
        chunk = prompt_ids[s : s + batch_size]
        out = _greedy(model, tokenizer, chunk, max_new_tokens, dev) if own else None
        if out is None:
            out = _hf_generate(model, tokenizer, chunk, max_new_tokens, dev)
        texts += [tokenizer.decode(o, skip_special_tokens=True) for o in out]
    return texts


_PROCESSOR_FIELDS = {  # generation-config fields that make greedy decoding more than an argmax, and their no-op values
    "repetition_penalty": (None, 1.0), "no_repeat_ngram_size": (None, 0), "encoder_no_repeat_ngram_size": (None, 0),
    "bad_words_ids": (None,), "min_length": (None, 0), "min_new_tokens": (None, 0), "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,), "suppress_tokens": (None,), "begin_suppress_tokens": (None,),
    "sequence_bias": (None,), "exponential_decay_length_penalty": (None,), "renormalize_logits": (None, False),
}  # fmt: skip


def _plain_greedy(model) -> bool:
    gc = getattr(model, "generation_config", None)
    return gc is None or all(getattr(gc, k, None) in ok for k, ok in _PROCESSOR_FIELDS.items())


def _cache_kw(model) -> str:
    """transformers >= 5.2x renamed ``past_key_values`` to ``cache`` (the old name warns): ask the model (peft's
    wrapper takes ``**kwargs``, so its base model is asked)."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def _greedy(
    model, tokenizer, chunk: Sequence, max_new_tokens: int, dev, embeds: bool = False
) -> Tensor | None:
    """``[batch, n_new]`` greedy tokens of each prompt of ``chunk`` (token id lists, or with ``embeds`` input
    embeddings ``[len, d_model]``); None when the model's cache is not made of plain dynamic layers."""
    from transformers.cache_utils import DynamicLayer

    kw = _cache_kw(model)
    caches, first = [], []
    for p in chunk:  # prefill each prompt alone: no padding
        x = {"inputs_embeds": p[None]} if embeds else {"input_ids": torch.tensor([p], device=dev)}
        out = model(**x, use_cache=True, logits_to_keep=1)
        cache = getattr(out, "cache", None) or out.past_key_values
        if not all(type(layer) is DynamicLayer for layer in getattr(cache, "layers", [None])):
            return None
        caches.append(cache)
        first.append(out.logits[:, -1].argmax(-1))
    lengths = torch.tensor([len(p) for p in chunk], device=dev)
    width = int(lengths.max())
    batched = caches[0]  # its layers take the left-padded tensors of every row
    for i, layer in enumerate(batched.layers):
        for name in ("keys", "values"):
            rows = [getattr(c.layers[i], name) for c in caches]  # each [1, kv_heads, len, d_head]
            setattr(layer, name, torch.cat([F.pad(r, (0, 0, width - r.shape[2], 0)) for r in rows]))
    mask = (torch.arange(width, device=dev) >= (width - lengths)[:, None]).long()
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    nxt = torch.cat(first)
    done = nxt == eos if eos is not None else torch.zeros_like(nxt, dtype=torch.bool)
    new = [nxt]
    for t in range(1, max_new_tokens):
        if bool(done.all()):
            break
        mask = torch.cat([mask, mask.new_ones((len(chunk), 1))], 1)
        out = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=(lengths + t - 1)[:, None],
                    use_cache=True, logits_to_keep=1, **{kw: batched})  # fmt: skip
        nxt = out.logits[:, -1].argmax(-1)
        nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
        done = done | (nxt == eos) if eos is not None else done
        new.append(nxt)
    return torch.stack(new, 1)


def _hf_generate(model, tokenizer, chunk: Sequence[list[int]], max_new_tokens: int, dev) -> Tensor:
    pad = tokenizer.pad_token_id
    b = collate([(p, []) for p in chunk], pad)
    out = model.generate(input_ids=b.input_ids.to(dev), attention_mask=b.attention_mask.to(dev),
                         max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad,
                         eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    return out[:, b.input_ids.shape[1] :]


@torch.no_grad()
def generate_embeds(
    model, tokenizer, inputs_embeds: Tensor, attention_mask: Tensor, max_new_tokens: int
) -> list[str]:
    """Greedy generation from left-padded input embeddings ``[batch, pos, d_model]`` (embedding attack); each row's
    real positions are prefilled alone, as :func:`generate` does."""
    dev = inputs_embeds.device
    out = None
    if _plain_greedy(model):
        rows = [inputs_embeds[r][attention_mask[r].bool()] for r in range(inputs_embeds.shape[0])]
        out = _greedy(model, tokenizer, rows, max_new_tokens, dev, embeds=True)
    if out is None:
        out = model.generate(inputs_embeds=inputs_embeds, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    return [tokenizer.decode(o, skip_special_tokens=True) for o in out]
