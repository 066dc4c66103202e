"""The audit behind ``reprlab otcclip audit``: rank a dataset's image-caption pairs by how suspicious they are
[ours, beyond the paper]; :mod:`..pipeline.audit` runs it on a user dataset or a run's testbed.

For each pair i with image features (u_i, V_i) and caption features (w_i, T_i) we compute the OTCCLIP
matching score of its own caption, S_own = alpha cos(u_i, w_i) - (1 - alpha) D(V_i, T_i), and re-run
OTCCLIP re-matching against a pool of the dataset's captions (global top-k shortlist, OT re-ranking). The
suspicion score is the margin S_best - S_own: how much better the best other caption fits the image than
its own. Pairs whose best caption is a different text with a positive margin are flagged; the report
lists the top pairs with thumbnails and the suggested caption (:func:`write_outputs`).
"""

from __future__ import annotations

import base64
import csv
import html
import io
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from reprlab.errors import ConfigError
from reprlab.methods.otcclip.config import OTConfig
from reprlab.methods.otcclip.data.pairs import PairSet
from reprlab.methods.otcclip.data.transforms import to_input
from reprlab.methods.otcclip.defenses.losses import ot_solve
from reprlab.methods.otcclip.defenses.matching import otc_rematch


@dataclass
class AuditResult:
    """Per pair (length N): ``score`` margin, ``cos`` own cosine, ``ot`` own OT distance, ``suggested``
    caption index into the dataset, ``flagged`` bool. ``ot_max_marginal_error`` and ``ot_converged_share``
    summarise every OT solve of the audit (own captions and candidates)."""

    score: np.ndarray
    cos: np.ndarray
    ot: np.ndarray
    suggested: np.ndarray
    flagged: np.ndarray
    ot_max_marginal_error: float = float("nan")
    ot_converged_share: float = float("nan")


def validate_options(
    top: int = 50, top_k: int = 16, alpha: float = 0.5, max_items: int | None = None
) -> None:
    """Reject audit options that cannot work, naming the CLI option.

    Raises:
        ConfigError: ``--top-k`` < 1, ``--alpha`` outside [0, 1], ``--top`` < 0, ``--max-items`` < 1.
    """
    if top_k < 1:
        raise ConfigError(f"--top-k must be >= 1 (captions shortlisted per image); got {top_k}")
    if not 0.0 <= alpha <= 1.0:
        raise ConfigError(f"--alpha must be in [0, 1] (S = alpha cos - (1 - alpha) OT); got {alpha}")
    if top < 0:
        raise ConfigError(f"--top must be >= 0 (pairs shown in the HTML report); got {top}")
    if max_items is not None and max_items < 1:
        raise ConfigError(f"--max-items must be >= 1 (or omitted for all pairs); got {max_items}")


@torch.no_grad()
def audit_pairs(
    model,
    tokenizer,
    pairs: PairSet,
    top_k: int = 16,
    alpha: float = 0.5,
    ot: OTConfig | None = None,
    batch_size: int = 256,
    pool_size: int = 4096,
    seed: int = 0,
) -> AuditResult:
    """Score every pair of ``pairs`` (see module docstring).

    Args:
        model: TinyCLIP, :class:`HFCLIPAdapter` or :class:`OpenCLIPAdapter`.
        tokenizer: with ``encode(texts, max_len)`` / ``decode``.
        pairs: images ``uint8 (N, C, H, W)`` and captions.
        top_k, alpha, ot: re-matching settings (as in training).
        pool_size: captions in the candidate pool (a seeded random subset when N is larger).
    """
    validate_options(top_k=top_k, alpha=alpha)
    ot = ot or OTConfig()
    was = model.training
    model.eval()
    dev = next(model.parameters()).device
    ids, mask = tokenizer.encode(pairs.captions, model.cfg.max_len)
    n = len(pairs)
    pool_idx = (
        torch.arange(n)
        if n <= pool_size
        else torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:pool_size]
    )
    tg, tt = [], []
    for s in range(0, len(pool_idx), batch_size):
        f = model.encode_text(
            ids[pool_idx[s : s + batch_size]].to(dev), mask[pool_idx[s : s + batch_size]].to(dev)
        )
        tg.append(f.global_)
        tt.append(f.tokens)
    pool_g, pool_t, pool_m = torch.cat(tg), torch.cat(tt), mask[pool_idx].to(dev)
    out = {k: [] for k in ("score", "cos", "ot", "suggested")}
    errs, conv = [], []
    for s in range(0, n, batch_size):
        rows = slice(s, min(n, s + batch_size))
        img = model.encode_image(to_input(pairs.images[rows]).to(dev))
        txt = model.encode_text(ids[rows].to(dev), mask[rows].to(dev))
        cos = (img.global_ * txt.global_).sum(-1)
        own_ot = ot_solve(
            img.patches, txt.tokens, img.mask, txt.mask, ot, matching=True
        )  # solved like the candidates
        d = own_ot.cost
        own = alpha * cos - (1 - alpha) * d
        match = otc_rematch(img.global_, img.patches, pool_g, pool_t, pool_m, top_k, alpha, ot, img.mask)
        for r in (own_ot, match.ot_result):
            errs.append(float(r.marginal_error.max()))
            conv.append(r.converged.cpu())
        out["score"].append((match.score - own).cpu())
        out["cos"].append(cos.cpu())
        out["ot"].append(d.cpu())
        out["suggested"].append(pool_idx[match.index.cpu()])
    model.train(was)
    res = {k: torch.cat(v).numpy() for k, v in out.items()}
    caps = np.asarray(pairs.captions, dtype=object)
    different = caps[res["suggested"]] != caps
    err, share = max(errs), float(torch.cat(conv).float().mean())
    if share < 1 and ot.match_tol is not None:
        warnings.warn(
            f"audit: {1 - share:.1%} of the OT solves stayed above match_tol {ot.match_tol:g} (largest "
            f"marginal error {err:.2e}); scores near 0 may be unreliable",
            RuntimeWarning,
            stacklevel=2,
        )
    return AuditResult(
        res["score"], res["cos"], res["ot"], res["suggested"], different & (res["score"] > 0), err, share
    )


def precision_recall(result: AuditResult, is_poison: np.ndarray, top: int | None = None) -> dict[str, float]:
    """Precision/recall of the flagged set (or of the ``top`` highest scores) against known poisons."""
    if top is None:
        flagged = result.flagged
    else:
        flagged = np.zeros(len(result.score), bool)
        flagged[np.argsort(-result.score)[:top]] = True
    tp = int((flagged & is_poison).sum())
    return {
        "precision": tp / max(int(flagged.sum()), 1),
        "recall": tp / max(int(is_poison.sum()), 1),
        "n_flagged": int(flagged.sum()),
    }


def _thumb(img: np.ndarray) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    arr = img.transpose(1, 2, 0)
    plt.imsave(buf, arr.squeeze(-1) if arr.shape[-1] == 1 else arr, cmap="gray", format="png")
    return base64.b64encode(buf.getvalue()).decode()


def write_outputs(
    out: Path, pairs: PairSet, names: list[str], result: AuditResult, top: int, extra: dict | None = None
) -> None:
    """``flagged.csv`` (all pairs ranked, flag column), ``audit.html`` (top pairs with thumbnails), ``audit.json``."""
    out.mkdir(parents=True, exist_ok=True)
    order = np.argsort(-result.score)
    with open(out / "flagged.csv", "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(
            ["rank", "index", "image", "caption", "suggested_caption", "score", "cos", "ot", "flagged"]
        )
        for r, i in enumerate(order):
            w.writerow(
                [
                    r,
                    int(i),
                    names[i],
                    pairs.captions[i],
                    pairs.captions[result.suggested[i]],
                    f"{result.score[i]:.4f}",
                    f"{result.cos[i]:.4f}",
                    f"{result.ot[i]:.4f}",
                    int(result.flagged[i]),
                ]
            )
    rows = []
    for i in order[:top]:
        rows.append(
            f"<tr><td><img src='data:image/png;base64,{_thumb(pairs.images[i].numpy())}' width=84></td>"
            f"<td>{html.escape(names[i])}</td><td>{html.escape(pairs.captions[i])}</td>"
            f"<td>{html.escape(pairs.captions[result.suggested[i]])}</td><td>{result.score[i]:.3f}</td>"
            f"<td>{'yes' if result.flagged[i] else ''}</td></tr>"
        )
    summary = {"n_pairs": len(pairs), "n_flagged": int(result.flagged.sum()), **(extra or {})}
    (out / "audit.json").write_text(json.dumps(summary, indent=2))
    (out / "audit.html").write_text(
        "<html><head><meta charset='utf-8'><title>OTCCLIP audit</title></head><body>"
        f"<h1>OTCCLIP audit</h1><pre>{html.escape(json.dumps(summary, indent=2))}</pre>"
        "<p>Score = best re-matching score of another caption minus the own caption's score "
        "(alpha cos - (1 - alpha) OT distance); flagged = a different caption fits better.</p>"
        "<table border=1 cellpadding=4><tr><th>image</th><th>name</th><th>caption</th><th>suggested</th>"
        f"<th>score</th><th>flagged</th></tr>{''.join(rows)}</table></body></html>",
        encoding="utf-8",
    )
