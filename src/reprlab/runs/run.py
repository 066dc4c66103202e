"""The run folder: resolved config, metrics, checkpoints, artefacts, summary and report inputs.

Layout::

    <run_dir>/config.yaml      resolved config (after YAML + overrides)
              env.json         versions, git commit, seed, device, command line
              metrics.jsonl    one JSON object per logged step
              summary.json     flat headline metrics (the contract every recipe fills)
              checkpoints/     <tag>/step_XXXXXXXX/ (safetensors + optimizer + RNG), atomic
              stages/          <name>.json, results of finished pipeline stages
              artifacts/ ...   JSON artefacts that reports are built from
              report.md, report.html

Resume: every durable event (a checkpoint or a finished stage) records how many metric lines existed when
it happened. A resumed run first truncates ``metrics.jsonl`` back to the latest durable event, then the
recipe re-executes: finished stages are read back, training loops restart from their checkpoints, so the
metrics of a resumed run equal those of an uninterrupted one.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
import yaml

from reprlab.config import config_to_dict
from reprlab.runs.atomic import atomic_write_json, atomic_write_text, dumps_json, read_json
from reprlab.runs.checkpoint import list_checkpoints, load_checkpoint_dir, save_checkpoint_dir

T = TypeVar("T")


class RunExistsError(FileExistsError):
    """The run folder already holds a run and neither resume nor overwrite was asked for."""


def _git_sha() -> str | None:
    try:
        here = Path(__file__).resolve().parent
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("reprlab", "torch", "transformers", "peft", "numpy", "scikit-learn", "pot"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


class Run:
    """A run folder and everything a recipe writes into it.

    Use :meth:`create`; the CLI does this for you.
    """

    def __init__(self, run_dir: Path, cfg: Any, recipe: str, resume: bool, quiet: bool, device: torch.device):
        self.dir = Path(run_dir)
        self.cfg = cfg
        self.recipe = recipe
        self.resume = resume
        self.quiet = quiet
        self.device = device
        self.rank = int(os.environ.get("RANK", "0"))
        self.is_main = self.rank == 0
        self.logger = logging.getLogger(f"reprlab.{recipe}")
        self._metrics_path = self.dir / "metrics.jsonl"

    # ------------------------------------------------------------------ creation
    @classmethod
    def create(
        cls,
        run_dir: Path | str,
        cfg: Any,
        recipe: str,
        resume: bool = False,
        overwrite: bool = False,
        quiet: bool = False,
        argv: list[str] | None = None,
    ) -> Run:
        """Create (or reopen with ``resume=True``) a run folder.

        Raises:
            RunExistsError: the folder already holds a run and neither ``resume`` nor ``overwrite`` is set.
        """
        run_dir = Path(run_dir)
        existing = (run_dir / "config.yaml").exists()
        if existing and not (resume or overwrite):
            raise RunExistsError(f"{run_dir} already holds a run; pass --resume to continue it or choose --out")
        if overwrite and existing and not resume:
            import shutil

            for child in ("metrics.jsonl", "summary.json", "checkpoints", "stages", "artifacts"):
                p = run_dir / child
                shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
        device_name = getattr(cfg, "device", "auto")
        if device_name in (None, "auto"):
            device_name = "cuda" if torch.cuda.is_available() else "cpu"
        run = cls(run_dir, cfg, recipe, resume=resume and existing, quiet=quiet, device=torch.device(device_name))
        if run.is_main:
            run.dir.mkdir(parents=True, exist_ok=True)
            resolved = config_to_dict(cfg)
            if run.resume:
                saved = yaml.safe_load((run_dir / "config.yaml").read_text())
                if saved != resolved:
                    raise ValueError(
                        f"{run_dir}/config.yaml differs from the config given for --resume; "
                        "resume with the same recipe and overrides"
                    )
                run._truncate_metrics_to_last_durable_event()
            atomic_write_text(run.dir / "config.yaml", f"# recipe: {recipe}\n" + yaml.safe_dump(resolved, sort_keys=False))
            atomic_write_json(run.dir / "env.json", {
                "recipe": recipe, "seed": getattr(cfg, "seed", None), "device": str(run.device),
                "git_commit": _git_sha(), "versions": _versions(), "platform": platform.platform(),
                "command": argv if argv is not None else sys.argv, "resumed": run.resume,
                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "cpu_threads": torch.get_num_threads(), "cuda": torch.cuda.is_available(),
            })  # fmt: skip
        return run

    # ------------------------------------------------------------------ metrics and artefacts
    def _metric_lines(self) -> int:
        if not self._metrics_path.exists():
            return 0
        with open(self._metrics_path, "rb") as fh:
            return sum(1 for _ in fh)

    def _truncate_metrics_to_last_durable_event(self) -> None:
        marks = [0]
        for tag_dir in (self.dir / "checkpoints").glob("*"):
            for ckpt in list_checkpoints(tag_dir):
                marks.append(read_json(ckpt / "meta.json").get("metric_lines", 0))
        for stage in (self.dir / "stages").glob("*.json"):
            marks.append(read_json(stage).get("metric_lines", 0))
        keep = max(marks)
        if self._metrics_path.exists():
            lines = self._metrics_path.read_text(encoding="utf-8").splitlines(keepends=True)
            atomic_write_text(self._metrics_path, "".join(lines[:keep]))
            if len(lines) > keep:
                self.logger.info("resume: dropped %d metric lines logged after the last checkpoint", len(lines) - keep)

    def log(self, step: int, **metrics: Any) -> None:
        """Append ``{"step": step, **metrics}`` to ``metrics.jsonl`` (main rank only)."""
        if not self.is_main:
            return
        line = dumps_json({"step": int(step), **metrics}, indent=None)
        with open(self._metrics_path, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")
            fh.flush()

    def save_json(self, relpath: str, obj: Any) -> Path:
        """Write a JSON artefact inside the run folder atomically; returns its path."""
        path = self.dir / relpath
        if self.is_main:
            atomic_write_json(path, obj)
        return path

    def load_json(self, relpath: str) -> Any:
        return read_json(self.dir / relpath)

    def has(self, relpath: str) -> bool:
        return (self.dir / relpath).exists()

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(
        self,
        step: int,
        modules: dict[str, torch.nn.Module],
        optimizers: dict[str, torch.optim.Optimizer] | None = None,
        extra: dict[str, Any] | None = None,
        tag: str = "train",
        keep_last: int = 2,
        keep_every: int | None = None,
    ) -> Path | None:
        """Atomically save weights (safetensors), optimizer and RNG state under ``checkpoints/<tag>/``."""
        if not self.is_main:
            return None
        return save_checkpoint_dir(
            self.dir / "checkpoints" / tag, step, modules, optimizers, extra,
            meta={"metric_lines": self._metric_lines(), "time": time.time()},
            keep_last=keep_last, keep_every=keep_every,
        )  # fmt: skip

    def load_checkpoint(
        self,
        modules: dict[str, torch.nn.Module],
        optimizers: dict[str, torch.optim.Optimizer] | None = None,
        tag: str = "train",
        restore_rng: bool = True,
    ) -> tuple[int, dict[str, Any]] | None:
        """Restore the latest checkpoint of ``tag``; ``None`` when there is none."""
        ckpts = list_checkpoints(self.dir / "checkpoints" / tag)
        if not ckpts:
            return None
        step, extra = load_checkpoint_dir(ckpts[-1], modules, optimizers, restore_rng=restore_rng)
        self.logger.info("resumed %s from %s", tag, ckpts[-1])
        return step, extra

    def checkpoints(self, tag: str = "train") -> list[Path]:
        """Checkpoint folders of a tag, oldest first."""
        return list_checkpoints(self.dir / "checkpoints" / tag)

    # ------------------------------------------------------------------ stages
    def stage(self, name: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` once; its JSON-able result is kept in ``stages/<name>.json`` and read back on resume."""
        path = self.dir / "stages" / f"{name}.json"
        if path.exists():
            self.logger.info("stage %s already done; reading it back", name)
            return read_json(path)["result"]
        result = fn()
        if self.is_main:
            atomic_write_json(path, {"result": result, "metric_lines": self._metric_lines(), "time": time.time()})
        # Round-trip through JSON so a fresh and a resumed run see identical types (tuples become lists).
        return json.loads(dumps_json(result, indent=None))

    # ------------------------------------------------------------------ progress
    def progress(self, iterable: Iterable[T], total: int | None = None, desc: str = "") -> Iterator[T]:
        """Iterate with a rich progress bar (silent in quiet mode and on non-main ranks)."""
        from reprlab.train.progress import progress

        return progress(iterable, total=total, desc=desc, disable=self.quiet or not self.is_main)

    # ------------------------------------------------------------------ summary
    def write_summary(self, summary: dict[str, Any]) -> Path:
        """Write the flat ``summary.json``; nested values are rejected because the contract is flat."""
        for key, value in summary.items():
            if isinstance(value, dict | list | tuple):
                raise TypeError(f"summary.json is flat: key {key!r} holds a {type(value).__name__}")
        return self.save_json("summary.json", summary)
