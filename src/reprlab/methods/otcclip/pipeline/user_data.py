"""A streamed run on user data, before training: the ``files`` stage (``data.testbed: files``: Fashion-MNIST
written as a user's files, :mod:`..data.fashion_files`), the ``poison`` stage (``poison.enabled``: the source
poisoned into ``<run>/poisoned`` as ``reprlab otcclip poison`` does), and the run's folder evaluation with the
defaults those stages give (``eval.*`` keys left '' point at the written folders and manifest).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

from reprlab.methods.otcclip.config import Config, EvalConfig
from reprlab.methods.otcclip.data.fashion_files import write_fashion_files
from reprlab.methods.otcclip.data.poison_shards import poison_dataset
from reprlab.methods.otcclip.data.shards import MANIFEST
from reprlab.methods.otcclip.evaluation.folder import FolderEval
from reprlab.runs import Run

# [ours] the files testbed's pool of held-out test items its targets are picked from
TARGET_POOL = 50


def files_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "files"


def training_source(cfg: Config, run_dir: Path) -> str:
    """What a streamed run trains on: the poisoned copy, else the files testbed's captions, else stream.source."""
    if cfg.poison.enabled:
        return str(Path(run_dir) / "poisoned")
    if cfg.data.testbed == "files":
        return str(files_dir(run_dir) / "captions.csv")
    return cfg.stream.source


def prepare(cfg: Config, run: Run) -> str:
    """Run the ``files`` and ``poison`` stages the config asks for (rank 0 writes); returns the training source."""
    d, files = cfg.data, files_dir(run.dir)
    if d.testbed == "files":

        def write_files() -> dict:
            if run.is_main:
                shutil.rmtree(files, ignore_errors=True)  # a half-written folder of an interrupted stage
                write_fashion_files(files, d.n_pairs, d.n_probe_train, d.n_eval, TARGET_POOL, cfg.seed)
            return {"n_train": d.n_pairs, "n_probe_train": d.n_probe_train, "n_test": d.n_eval}

        run.stage("files", write_files)
    if cfg.poison.enabled:
        pcfg = cfg.poison
        if d.testbed == "files" and not pcfg.targets and not pcfg.targets_from:
            pcfg = replace(pcfg, targets_from=str(files / "targets"))
        src = str(files / "captions.csv") if d.testbed == "files" else cfg.stream.source
        out = Path(run.dir) / "poisoned"

        def write_poison() -> dict:
            if run.is_main:
                shutil.rmtree(out, ignore_errors=True)
                m = poison_dataset(src, out, pcfg, cfg.seed, cfg.stream.image_root)
                return {"n_samples": m["n_samples"], "n_poisoned": m["n_poisoned"]}
            return {}

        run.stage("poison", write_poison)
    return training_source(cfg, run.dir)


def eval_config(cfg: Config, run_dir: Path) -> tuple[EvalConfig, str]:
    """The run's ``eval:`` with the files testbed's folders filled in, and the default poison manifest (the poison
    stage's, else stream.source's own manifest.json when it has a poison record, else '')."""
    e, files = cfg.eval, files_dir(run_dir)
    if cfg.data.testbed == "files":
        e = replace(
            e,
            zeroshot_dir=e.zeroshot_dir or str(files / "test"),
            probe_train_dir=e.probe_train_dir or str(files / "probe_train"),
            templates=e.templates or str(files / "templates.txt"),
        )
    manifest = ""
    if cfg.poison.enabled:
        manifest = str(Path(run_dir) / "poisoned" / MANIFEST)
    elif cfg.stream.source and Path(cfg.stream.source).is_dir():
        path = Path(cfg.stream.source) / MANIFEST
        if path.is_file() and isinstance(_json(path).get("poison"), dict):
            manifest = str(path)
    return e, manifest


def _json(path: Path) -> dict:
    """A JSON object, or ``{}`` for a file that is not one (a shards manifest of another tool)."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    return obj if isinstance(obj, dict) else {}


def folder_eval(cfg: Config, run_dir: Path) -> FolderEval | None:
    """The run's :class:`FolderEval`, or ``None`` when ``eval.zeroshot_dir`` is '' (and no files testbed)."""
    e, manifest = eval_config(cfg, run_dir)
    return FolderEval(e, manifest, cfg.seed) if e.zeroshot_dir else None
