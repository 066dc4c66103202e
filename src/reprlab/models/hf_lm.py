"""A Hugging Face causal LM behind our GPT's call: ``ids (batch, pos) -> logits (batch, pos - start, d_vocab)``.

Every Reason-to-Rote stage (training loss, exact match, logit lens, probes, INLP, circuits, neurons) calls
``model(ids)`` and reads hook names; :class:`HFCausalLM` gives a ``transformers`` causal LM that call, and
:mod:`reprlab.hooks.sites` resolves hook names on the model it wraps (``hf_model``), so the same analysis code
runs on our GPT, GPT-2, Llama, SmolLM2, Qwen and other GPT-2- or Llama-style layouts.

``start > 0`` keeps only the logits of positions ``>= start`` through HF's ``logits_to_keep`` (the
unembedding of a 49k-token vocabulary is a fifth of SmolLM2-135M's forward pass, and an answer-only loss
reads six positions of sixteen). Sequences are right-padded, so no attention mask is passed: under the
causal mask a real position never attends to a later pad, as in our GPT.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


class HFCausalLM(nn.Module):
    """Wrap ``hf_model`` (a ``transformers`` ``*ForCausalLM``) so that ``forward(ids, start)`` returns logits."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf_model = hf_model

    @property
    def config(self):
        return self.hf_model.config

    def forward(self, ids: Tensor, start: int = 0) -> Tensor:
        """ids: (batch, pos) -> logits (batch, pos - start, d_vocab) (float32 whatever the weights' dtype)."""
        if not 0 <= start < ids.shape[1]:
            raise ValueError(f"start={start} must be in [0, {ids.shape[1]})")
        keep = ids.shape[1] - start if start else 0  # HF: 0 keeps every position
        return self.hf_model(input_ids=ids, use_cache=False, logits_to_keep=keep).logits.float()


def argmax_from(model: nn.Module, ids: Tensor, first: int) -> Tensor:
    """(batch, pos) greedy next-token ids, valid at positions ``>= first``.

    An :class:`HFCausalLM` unembeds only those positions (the columns before ``first`` are 0); any other
    model (our GPT) runs its plain forward pass, so its numbers do not change.
    """
    if isinstance(model, HFCausalLM) and 0 < first < ids.shape[1]:
        return F.pad(model(ids, start=first).argmax(-1), (first, 0))
    return model(ids).argmax(-1)
