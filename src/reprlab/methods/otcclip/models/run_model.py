"""The model of a finished run: what a run saves of its tokenizer, and the model, tokenizer and config rebuilt
from its folder (the audit; evaluating a run's checkpoints or exporting them starts here).
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from reprlab.config import load_config
from reprlab.errors import ConfigError, RunFolderError
from reprlab.methods.otcclip.config import Config
from reprlab.methods.otcclip.data.tokenizer import WordTokenizer
from reprlab.methods.otcclip.models.build import build_model, build_tokenizer
from reprlab.recipes import recipe_name_of_run
from reprlab.runs import Run
from reprlab.runs.checkpoint import list_checkpoints, load_checkpoint_dir


def save_tokenizer(run: Run, tok) -> None:
    """``artifacts/tokenizer.json``: our word tokenizer's vocabulary, or what identifies open_clip's tokenizer (the
    audit rebuilds a run's tokenizer from it, :func:`run_tokenizer`); a Hugging Face tokenizer is its
    ``model.tokenizer`` folder and saves nothing."""
    if run.is_main and hasattr(tok, "save"):
        (run.dir / "artifacts").mkdir(parents=True, exist_ok=True)
        tok.save(run.dir / "artifacts" / "tokenizer.json")


def run_config(run_dir: Path) -> Config:
    """The resolved config an ``otcclip-*`` run saved (``config.yaml``).

    Raises:
        RunFolderError: ``run_dir`` has no ``config.yaml`` (not a run folder), or one another recipe wrote.
    """
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise RunFolderError(f"{run_dir} is not a run folder (no config.yaml)")
    text = path.read_text(encoding="utf-8")
    try:
        return load_config(Config, yaml.safe_load(text))
    except ConfigError as err:  # another method's run: say so, not which of its keys we do not know
        made_by = recipe_name_of_run(run_dir) or "unknown"
        raise RunFolderError(
            f"{run_dir} is not an otcclip run: its config.yaml (recipe {made_by}) does not load as one ({err})"
        ) from err


def load_run_model(run_dir: Path, defense: str = "otcclip"):
    """Rebuild the model an ``otcclip-*`` run trained (the arch its resolved config names: ``tiny``, ``hf_clip``
    or ``open_clip:<name>``, through ``build_model``), its tokenizer (:func:`run_tokenizer`) and checkpoint.

    Raises:
        RunFolderError: not a run folder (no ``config.yaml``).
        ModelNotAvailableError: ``open_clip:<name>`` where open-clip-torch does not import.
    """
    run_dir = Path(run_dir)
    cfg = run_config(run_dir)
    ckpts = list_checkpoints(run_dir / "checkpoints" / defense)
    if not ckpts:
        trained = sorted(p.name for p in (run_dir / "checkpoints").glob("*") if list_checkpoints(p))
        raise RunFolderError(
            f"{run_dir} has no checkpoint of defense {defense!r}; it has {trained or 'none'}",
            hint="choose one of them (the audit: --defense NAME), or train the defense first",
        )
    channels = 3 if cfg.data.tint else 1
    data_info = run_dir / "analysis" / "data.json"
    if data_info.is_file():  # a streamed run records the channels it trained with (user data: RGB)
        channels = int(json.loads(data_info.read_text()).get("channels", channels))
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
    tok_path = Path(run_dir) / "artifacts" / "tokenizer.json"
    if cfg.model.arch.startswith("open_clip:"):
        return build_tokenizer(cfg.model)
    if tok_path.exists():
        return WordTokenizer.load(tok_path)
    if cfg.model.arch == "hf_clip" and cfg.model.tokenizer:
        return build_tokenizer(cfg.model)
    raise RunFolderError(f"{tok_path} is missing: the run's word tokenizer (its vocabulary) is saved there, and "
                         "without it the text tower's token ids cannot be rebuilt",
                         hint="restore the file from a copy of the run folder, or re-run the recipe")  # fmt: skip
