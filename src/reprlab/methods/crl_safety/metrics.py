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


def benign_kl(model, pairs, base_rows: list[torch.Tensor], pad_id: int) -> float:
    """Mean per-token KL(base || model) over the response tokens of ``pairs``."""
    rows = response_logit_rows(model, pairs, pad_id)
    p = F.log_softmax(torch.cat(base_rows), -1)
    q = F.log_softmax(torch.cat(rows), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


@torch.no_grad()
def response_states(model, pairs, pad_id: int, layers: list[int], batch_size: int = 8):
    """``(token states [layers, n_tok, d_model], sequence means [n_seq, layers, d_model])``."""
    dev = next(model.parameters()).device
    toks, means = [], []
    for s in range(0, len(pairs), batch_size):
        b = collate(pairs[s : s + batch_size], pad_id).to(dev)
        o = forward(model, b.attention_mask, input_ids=b.input_ids, logits_last=1)
        hs = torch.stack([o.hidden_states[i] for i in layers], 1)  # [batch, layers, pos, d_model]
        m = b.response_mask
        toks.append(torch.stack([o.hidden_states[i][m] for i in layers]).float().cpu())
        w = m[:, None, :, None].float()
        means.append(((hs * w).sum(2) / w.sum(2).clamp(min=1)).float().cpu())
    return torch.cat(toks, 1), torch.cat(means, 0)


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
              frozen_model=None) -> dict[str, list[float]]:  # fmt: skip
    """Per-layer cos(trained, frozen) on harmful/benign tokens and probe AUROC (harmful vs benign).

    Args:
        frozen_ctx: a context manager under which ``model`` acts as its frozen reference (peft's
            ``disable_adapter``), or ``frozen_model``: a separate reference model.
    """
    h_tok, h_mean = response_states(model, harmful_pairs, pad_id, layers)
    b_tok, b_mean = response_states(model, benign_pairs, pad_id, layers)
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
