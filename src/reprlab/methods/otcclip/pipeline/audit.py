"""``reprlab otcclip audit`` [ours, beyond the paper]: the audit (:mod:`..evaluation.audit`) of a user dataset with
a model from a run or a Hugging Face CLIP (:func:`audit_dataset`), and the recipe's audit stage, measured on our
poisoned pairs where the poisons are known (:func:`audit_testbed`).
"""

from __future__ import annotations

from pathlib import Path

from reprlab.errors import ConfigError
from reprlab.methods.otcclip.config import Config, OTConfig
from reprlab.methods.otcclip.data.datasets import load_pairs
from reprlab.methods.otcclip.data.testbed import Testbed
from reprlab.methods.otcclip.data.tokenizer import WordTokenizer
from reprlab.methods.otcclip.evaluation.audit import (
    audit_pairs,
    precision_recall,
    validate_options,
    write_outputs,
)
from reprlab.methods.otcclip.models.build import build_model
from reprlab.methods.otcclip.models.hf import load_hf_model
from reprlab.methods.otcclip.models.run_model import load_run_model
from reprlab.runs import Run


def audit_testbed(cfg: Config, run: Run, bed: Testbed, tok: WordTokenizer) -> dict:
    """``reprlab otcclip audit`` measured on our poisoned pairs, with the model trained under
    ``cfg.audit_defense`` (the user's situation: a CLIP trained on the data being audited)."""
    model = build_model(cfg.model, len(tok), bed.pairs.images.shape[1]).to(run.device)
    if run.load_checkpoint({"model": model}, tag=cfg.audit_defense, restore_rng=False) is None:
        raise FileNotFoundError(f"no checkpoint of defense {cfg.audit_defense!r} in {run.dir}")
    d = cfg.defense
    res = audit_pairs(model, tok, bed.pairs, top_k=d.top_k, alpha=d.alpha, ot=d.ot, seed=cfg.seed)
    poison = (bed.pairs.kind != 0).numpy()
    flagged = precision_recall(res, poison)
    at_n = precision_recall(res, poison, top=int(poison.sum()))
    if run.is_main:
        write_outputs(
            run.dir / "audit",
            bed.pairs,
            [f"pair{i}" for i in range(len(bed.pairs))],
            res,
            top=40,
            extra={"flagged": flagged, "top_n_poison": at_n},
        )
    return {
        "model": cfg.audit_defense,
        "precision": flagged["precision"],
        "recall": flagged["recall"],
        "n_flagged": flagged["n_flagged"],
        "alpha": d.alpha,
        "n_pairs": len(poison),
        "n_poison": int(poison.sum()),  # the precision a flag drawn at random would have, times n_pairs
        "precision_at_n_poison": at_n["precision"],
        "ot_max_marginal_error": res.ot_max_marginal_error,
        "ot_converged_share": res.ot_converged_share,
    }


def audit_dataset(
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
    validate_options(top, top_k, alpha, max_items)
    if (run_dir is None) == (hf_model is None):
        raise ConfigError(
            "give exactly one of --run RUN (run_dir: an otcclip run folder) or --hf-model ID (hf_model: a CLIP "
            "id or local folder)"
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
