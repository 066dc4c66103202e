"""``reprlab otcclip audit``: rank a dataset's image-caption pairs by how suspicious they are [ours, beyond
the paper].

For each pair i with image features (u_i, V_i) and caption features (w_i, T_i) we compute the OTCCLIP
matching score of its own caption, S_own = alpha cos(u_i, w_i) - (1 - alpha) D(V_i, T_i), and re-run
OTCCLIP re-matching against a pool of the dataset's captions (global top-k shortlist, OT re-ranking). The
suspicion score is the margin S_best - S_own: how much better the best other caption fits the image than
its own. Pairs whose best caption is a different text with a positive margin are flagged; the report
lists the top pairs with thumbnails and the suggested caption.
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
import yaml

from reprlab.errors import ConfigError
from reprlab.methods.otcclip.data.pairs import PairSet
from reprlab.methods.otcclip.data.transforms import to_input
from reprlab.methods.otcclip.defenses.config import OTConfig
from reprlab.methods.otcclip.defenses.losses import ot_solve
from reprlab.methods.otcclip.defenses.matching import otc_rematch
from reprlab.methods.otcclip.models.hf import load_hf_model


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


def load_run_model(run_dir: Path, defense: str = "otcclip"):
    """Rebuild the model an ``otcclip-*`` run trained (the arch its resolved config names: ``tiny``, ``hf_clip``
    or ``open_clip:<name>``, through ``build_model``), its tokenizer (:func:`run_tokenizer`) and checkpoint.

    Raises:
        ModelNotAvailableError: ``open_clip:<name>`` where open-clip-torch does not import.
    """
    from reprlab.config import load_config
    from reprlab.methods.otcclip.models.build import build_model
    from reprlab.methods.otcclip.recipe import Config
    from reprlab.runs.checkpoint import list_checkpoints, load_checkpoint_dir

    run_dir = Path(run_dir)
    cfg_path = run_dir / "config.yaml"
    if not cfg_path.exists():
        raise FileNotFoundError(f"{cfg_path} not found: is {run_dir} an otcclip run folder?")
    cfg = load_config(Config, yaml.safe_load(cfg_path.read_text()))
    ckpts = list_checkpoints(run_dir / "checkpoints" / defense)
    if not ckpts:
        raise FileNotFoundError(f"no checkpoint for defense {defense!r} under {run_dir / 'checkpoints'}")
    channels = 3 if cfg.data.tint else 1
    if cfg.model.arch.startswith("open_clip:"):
        # first: without open_clip, the clean ModelNotAvailableError
        model = build_model(cfg.model, 0, channels)
        tok = run_tokenizer(cfg, run_dir)
    else:
        tok = run_tokenizer(cfg, run_dir)
        model = build_model(cfg.model, len(tok), channels)
    load_checkpoint_dir(ckpts[-1], {"model": model}, None, restore_rng=False)  # bank/state are not needed
    return model, tok, cfg


def run_tokenizer(cfg, run_dir: Path):
    """The tokenizer a run trained with: open_clip's own for ``open_clip:<name>``; the word tokenizer the run
    saved (``artifacts/tokenizer.json``, a vocabulary list); else (an ``hf_clip`` run with ``model.tokenizer``,
    which saves none) the Hugging Face tokenizer of that folder."""
    from reprlab.methods.otcclip.data.tokenizer import WordTokenizer
    from reprlab.methods.otcclip.models.build import build_tokenizer

    tok_path = Path(run_dir) / "artifacts" / "tokenizer.json"
    if cfg.model.arch.startswith("open_clip:"):
        return build_tokenizer(cfg.model)
    if tok_path.exists():
        return WordTokenizer.load(tok_path)
    if cfg.model.arch == "hf_clip" and cfg.model.tokenizer:
        return build_tokenizer(cfg.model)
    raise FileNotFoundError(f"{tok_path} not found: is {run_dir} an otcclip run folder?")


def main(
    data: Path,
    out: Path,
    run_dir: Path | None = None,
    defense: str = "otcclip",
    hf_model: str | None = None,
    top: int = 50,
    top_k: int = 16,
    alpha: float = 0.5,
    max_items: int | None = None,
) -> dict:
    """Audit a user dataset with a model from an otcclip run (``run_dir``) or a Hugging Face CLIP.

    Writes ``out/flagged.csv``, ``out/audit.html`` and ``out/audit.json``; returns the summary.
    """
    from reprlab.methods.otcclip.data.datasets import load_pairs

    validate_options(top, top_k, alpha, max_items)
    if (run_dir is None) == (hf_model is None):
        raise ConfigError(
            "give exactly one of run_dir (an otcclip run folder) or hf_model (a CLIP id/folder)"
        )
    if run_dir is not None:
        model, tok, cfg = load_run_model(run_dir, defense)
        size = getattr(model, "image_size", cfg.model.image_size)  # open_clip: its preprocess_cfg size
        channels, ot = 3 if cfg.data.tint else 1, cfg.defense.ot
    else:
        model, tok = load_hf_model(hf_model)
        size, channels, ot = model.image_size, 3, OTConfig()
    pairs, names, report = load_pairs(data, image_size=size, channels=channels, max_items=max_items)
    result = audit_pairs(model, tok, pairs, top_k=top_k, alpha=alpha, ot=ot)
    ot_diag = {
        "ot_max_marginal_error": result.ot_max_marginal_error,
        "ot_converged_share": result.ot_converged_share,
    }
    extra = {"source": str(data), **report.as_summary("data"), **ot_diag, "data_notes": report.notes}
    write_outputs(Path(out), pairs, names, result, top, extra)
    return {
        "n_pairs": len(pairs),
        "n_flagged": int(result.flagged.sum()),
        **report.as_summary("data"),
        **ot_diag,
    }
