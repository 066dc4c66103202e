"""Utility and mechanism metrics [ours: small-scale metrics, see README.md].

- ``benign_kl``: KL(base || model) per response token on the base model's replies to held-out harmless
  prompts (0 for the base itself).
- ``mechanism``: per layer, the mean cos(h′, h) (raw, and centred on the frozen states' mean) between the model's and its frozen reference's states on
  harmful vs benign response tokens (the reference is the model it was fine-tuned from), and the
  cross-validated linear-probe AUROC separating harmful from benign sequences (mean response state) in
  the model's own states. Raw centroid cosine is avoided: shared high-norm directions dominate it.
"""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import torch
import torch.nn.functional as F

from reprlab.methods.crl_safety.chat import collate, forward, response_logits


@torch.no_grad()
def response_logit_rows(model, pairs, pad_id: int, batch_size: int = 8) -> list[torch.Tensor]:
    """Per pair, logits predicting its response tokens ``[n_response_i, d_vocab]``."""
    dev = next(model.parameters()).device
    out = []
    for s in range(0, len(pairs), batch_size):
        b = collate(pairs[s : s + batch_size], pad_id).to(dev)
        o = forward(
            model, b.attention_mask, input_ids=b.input_ids, hidden=False, logits_last=b.n_response + 1
        )
        lg, _, m = response_logits(o.logits, b)
        out += [lg[r][m[r]].float().cpu() for r in range(m.shape[0])]
    return out


def benign_kl(
    model, pairs, base_rows: list[torch.Tensor], pad_id: int, rows: list[torch.Tensor] | None = None
) -> float:
    """Mean per-token KL(base || model) over the response tokens of ``pairs`` (``rows``: the model's own
    :func:`response_logit_rows`, when a combined pass already has them)."""
    rows = response_logit_rows(model, pairs, pad_id) if rows is None else rows
    p = F.log_softmax(torch.cat(base_rows), -1)
    q = F.log_softmax(torch.cat(rows), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


@torch.no_grad()
def response_states(model, pairs, pad_id: int, layers: list[int], batch_size: int = 8):
    """``(token states [layers, n_tok, d_model], sequence means [n_seq, layers, d_model])``."""
    toks, means, _ = response_pass(model, pairs, pad_id, layers, batch_size)
    return toks, means


@torch.no_grad()
def response_pass(model, pairs, pad_id: int, layers: list[int], batch_size: int = 8, logits: bool = False):
    """:func:`response_states` and, with ``logits``, :func:`response_logit_rows` from one forward per batch
    (bitwise both: the head's ``logits_to_keep`` does not touch the hidden states).

    Returns:
        ``(token states [layers, n_tok, d_model], sequence means [n_seq, layers, d_model], logit rows or None)``.
    """
    dev = next(model.parameters()).device
    toks, means, rows = [], [], [] if logits else None
    for s in range(0, len(pairs), batch_size):
        b = collate(pairs[s : s + batch_size], pad_id).to(dev)
        o = forward(
            model, b.attention_mask, input_ids=b.input_ids, logits_last=b.n_response + 1 if logits else 1
        )
        hs = torch.stack([o.hidden_states[i] for i in layers], 1)  # [batch, layers, pos, d_model]
        m = b.response_mask
        toks.append(torch.stack([o.hidden_states[i][m] for i in layers]).float().cpu())
        w = m[:, None, :, None].float()
        means.append(((hs * w).sum(2) / w.sum(2).clamp(min=1)).float().cpu())
        if logits:
            lg, _, mr = response_logits(o.logits, b)
            rows += [lg[r][mr[r]].float().cpu() for r in range(mr.shape[0])]
    return torch.cat(toks, 1), torch.cat(means, 0), rows


def probe_auroc(x_pos: np.ndarray, x_neg: np.ndarray, seed: int = 0) -> float:
    """Cross-validated (stratified, up to 4 folds) logistic-regression AUROC of pos vs neg rows."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import roc_auc_score
    from sklearn.model_selection import StratifiedKFold, cross_val_predict
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    x = np.concatenate([x_pos, x_neg])
    y = np.r_[np.ones(len(x_pos)), np.zeros(len(x_neg))]
    folds = int(min(4, len(x_pos), len(x_neg)))
    if folds < 2:
        return float("nan")
    clf = make_pipeline(StandardScaler(), LogisticRegression(C=0.1, max_iter=2000))
    cv = StratifiedKFold(folds, shuffle=True, random_state=seed)
    scores = cross_val_predict(clf, x, y, cv=cv, method="decision_function")
    return float(roc_auc_score(y, scores))


def mechanism(model, harmful_pairs, benign_pairs, pad_id: int, layers: list[int], frozen_ctx=None,
              frozen_model=None, trained=None, frozen=None) -> dict[str, list[float]]:  # fmt: skip
    """Per-layer cos(trained, frozen) on harmful/benign tokens and probe AUROC (harmful vs benign).

    Args:
        frozen_ctx: a context manager under which ``model`` acts as its frozen reference (peft's
            ``disable_adapter``), or ``frozen_model``: a separate reference model.
        trained: the model's own :func:`response_states` of ``(harmful_pairs, benign_pairs)`` when already run.
        frozen: the frozen reference's token states ``(harmful [layers, n_tok, d_model], benign)`` when already
            run (e.g. read from a :class:`~reprlab.methods.crl_safety.frozen.FrozenStore`); then no frozen pass runs.
    """
    (h_tok, h_mean), (b_tok, b_mean) = trained or [response_states(model, p, pad_id, layers)
                                                   for p in (harmful_pairs, benign_pairs)]  # fmt: skip
    if frozen is not None:
        fh, fb = frozen
    else:
        ref = frozen_model if frozen_model is not None else model
        with frozen_ctx if frozen_ctx is not None else nullcontext():
            fh, _ = response_states(ref, harmful_pairs, pad_id, layers)
            fb, _ = response_states(ref, benign_pairs, pad_id, layers)
    cos_h = F.cosine_similarity(h_tok, fh, dim=-1).mean(-1)  # [layers]
    cos_b = F.cosine_similarity(b_tok, fb, dim=-1).mean(-1)
    # centred on the frozen states' balanced mean: raw cos is pinned near 1 by shared high-norm directions
    c = ((fh.mean(1) + fb.mean(1)) / 2).unsqueeze(1)  # [layers, 1, d_model]
    cc_h = F.cosine_similarity(h_tok - c, fh - c, dim=-1).mean(-1)
    cc_b = F.cosine_similarity(b_tok - c, fb - c, dim=-1).mean(-1)
    auroc = [probe_auroc(h_mean[:, i].numpy(), b_mean[:, i].numpy()) for i in range(len(layers))]
    return {
        "layers": layers,
        "cos_harmful": cos_h.tolist(),
        "cos_benign": cos_b.tolist(),
        "cos_harmful_centered": cc_h.tolist(),
        "cos_benign_centered": cc_b.tolist(),
        "probe_auroc": auroc,
    }
