"""``reprlab otcclip evaluate RUN_DIR``: a finished run's defenses evaluated on ImageFolders and a poison
manifest (:mod:`..evaluation.folder`), with the run's ``eval:`` settings unless options replace them; the same
summary keys as the recipes (``<defense>.zeroshot_acc`` ...), written to ``<out>/folder_eval.json``.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from reprlab.errors import ConfigError
from reprlab.methods.otcclip.evaluation.folder import FolderEval
from reprlab.methods.otcclip.models.run_model import load_run_model, run_config
from reprlab.methods.otcclip.pipeline.user_data import eval_config
from reprlab.runs.checkpoint import list_checkpoints

COLUMNS = ("zeroshot_acc", "linear_probe_acc", "asr_targeted", "asr_backdoor")


def evaluate_run(
    run_dir: Path, overrides: dict | None = None, defenses: list[str] | None = None, out: Path | None = None
) -> dict[str, float]:
    """Evaluate every defense of ``run_dir`` that has a checkpoint (or ``defenses``); ``overrides``: ``eval:``
    keys to replace ('' and ``None`` keep the run's). Returns the flat ``<defense>.<key>`` summary.

    Raises:
        RunFolderError: not a run folder. ConfigError: no ImageFolder to evaluate on, an unknown defense, no
        checkpoint. DataError: an unreadable folder, image or manifest (naming it).
    """
    run_dir = Path(run_dir)
    cfg = run_config(run_dir)  # RunFolderError without config.yaml
    e, manifest = eval_config(cfg, run_dir)
    e = replace(e, **{k: v for k, v in (overrides or {}).items() if v not in ("", None)})
    if not e.zeroshot_dir:
        raise ConfigError(
            "no ImageFolder to evaluate on: the run's eval.zeroshot_dir is ''",
            hint="give --zeroshot DIR (one sub-folder of images per class)",
        )
    folder = FolderEval(e, manifest, cfg.seed)
    names = defenses or list(cfg.defenses)
    unknown = [d for d in names if d not in cfg.defenses]
    if unknown:
        raise ConfigError(f"defense(s) {unknown} were not trained in {run_dir}; it has {list(cfg.defenses)}")
    done = [d for d in names if list_checkpoints(run_dir / "checkpoints" / d)]
    if not done:
        raise ConfigError(f"{run_dir} has no checkpoint of {names}: has the run trained?")
    summary: dict[str, float] = {}
    for d in done:
        model, tok, _ = load_run_model(run_dir, d)
        for k, v in folder(model, tok, cfg.model.max_len, probe=True).items():
            summary[f"{d}.{k}"] = v
    out = Path(out) if out else run_dir / "eval"
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "eval": {k: getattr(e, k) for k in e.__dataclass_fields__},
        "data": folder.info(),
        "summary": summary,
    }
    (out / "folder_eval.json").write_text(json.dumps(record, indent=2))
    return summary


def table(summary: dict[str, float]) -> str:
    """The summary as a plain-text table, one row per defense (the recipes' headline columns)."""
    defenses = list(dict.fromkeys(k.split(".", 1)[0] for k in summary))
    lines = ["defense".ljust(12) + "".join(c.rjust(18) for c in COLUMNS)]
    for d in defenses:
        cells = [summary.get(f"{d}.{c}") for c in COLUMNS]
        lines.append(d.ljust(12) + "".join(("-" if v is None else f"{v:.3f}").rjust(18) for v in cells))
    return "\n".join(lines)
