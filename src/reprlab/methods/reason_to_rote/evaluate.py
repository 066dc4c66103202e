"""Answer-level metrics: exact match against a chosen answer, per-digit accuracy, memorisation rates.

Exact match uses one teacher-forced pass: greedy decoding produces answer ``y`` exactly iff, at every
answer position, the argmax given the prefix of ``y`` is the next token of ``y`` (induction over
positions). So ``EM(y) = all_t argmax logits[t-1] == y[t]`` equals greedy-decode EM (tested against a
step-by-step greedy decoder), at the cost of one forward pass per target instead of one per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from reprlab.methods.reason_to_rote.dataset import Batch
from reprlab.models.hf_lm import HFCausalLM, argmax_from


@torch.no_grad()
def answer_matches(model: nn.Module, ids: Tensor, batch: Batch, batch_size: int = 1024) -> Tensor:
    """Per-token correctness of greedy predictions against the answer in ``ids``.

    Args:
        ids: (batch, pos) sequences whose answer span is the target (``batch.ids`` or ``batch.ids_true``).
        batch: supplies answer spans.

    Returns:
        (batch, max_answer_len) bool; positions beyond an item's answer length are True.
    """
    out = []
    max_len = int(batch.answer_len.max())
    if isinstance(model, HFCausalLM):  # a 49k-token unembedding of 1024 items takes GBs: fewer items
        batch_size = min(batch_size, 128)
    for s in range(0, len(batch), batch_size):
        x = ids[s : s + batch_size]
        # (b, pos); an HF model unembeds the answer positions only (earlier columns are unused here)
        pred = argmax_from(model, x, int(batch.answer_start[s : s + batch_size].min()) - 1)
        start = batch.answer_start[s : s + batch_size].to(x.device)
        alen = batch.answer_len[s : s + batch_size].to(x.device)
        offs = torch.arange(max_len, device=x.device)
        tgt_pos = (start[:, None] + offs).clamp(max=x.shape[1] - 1)  # (b, max_len)
        ok = pred.gather(1, tgt_pos - 1) == x.gather(1, tgt_pos)
        out.append((ok | (offs[None] >= alen[:, None])).cpu())
    return torch.cat(out)


def greedy_decode(model: nn.Module, prompt_ids: Tensor, n_tokens: int) -> Tensor:
    """Plain greedy decoding (prompts of equal length): (batch, prompt_len) -> (batch, n_tokens)."""
    x = prompt_ids
    with torch.no_grad():
        for _ in range(n_tokens):
            x = torch.cat([x, model(x)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return x[:, prompt_ids.shape[1] :]


@dataclass(frozen=True)
class AnswerMetrics:
    """Exact match and memorisation rates on one evaluation.

    Attributes:
        clean_test_em: EM on held-out clean items.
        clean_train_em: EM on clean training items.
        noisy_memorized: share of noisy training items answered exactly with their noisy label.
        noisy_true_answer: share of noisy training items answered exactly with the true answer.
        test_digit_acc: per-answer-token accuracy on the test items (teacher-forced), incl. EOS.
    """

    clean_test_em: float
    clean_train_em: float
    noisy_memorized: float
    noisy_true_answer: float
    test_digit_acc: list[float]


def evaluate(model: nn.Module, test: Batch, clean_train: Batch, noisy: Batch, device) -> AnswerMetrics:
    """Compute :class:`AnswerMetrics` (model is put in eval mode and left there)."""
    model.eval()
    t = answer_matches(model, test.ids.to(device), test)
    c = answer_matches(model, clean_train.ids.to(device), clean_train)
    mem = answer_matches(model, noisy.ids.to(device), noisy).all(1)
    tru = answer_matches(model, noisy.ids_true.to(device), noisy).all(1)
    return AnswerMetrics(
        clean_test_em=t.all(1).float().mean().item(), clean_train_em=c.all(1).float().mean().item(),
        noisy_memorized=mem.float().mean().item(), noisy_true_answer=tru.float().mean().item(),
        test_digit_acc=[round(v, 4) for v in t.float().mean(0).tolist()],
    )  # fmt: skip
