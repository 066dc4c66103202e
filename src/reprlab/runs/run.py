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
it happened. A resumed run first checks the newest checkpoint of every stage against its manifest
(:mod:`reprlab.runs.resume`; a damaged one stops the resume, naming the file), then truncates
``metrics.jsonl`` back to the latest durable event, then the recipe re-executes: finished stages are read
back, training loops restart from their checkpoints, so the metrics of a resumed run equal those of an
uninterrupted one.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
import yaml

from reprlab.config import config_to_dict
from reprlab.errors import RunFolderError
from reprlab.jsonfile import nonfinite_pointers, read_stage, restore_nonfinite, with_null_reasons
from reprlab.runs import faults
from reprlab.runs.atomic import (
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    dumps_json,
    read_json,
    write_error,
)
from reprlab.runs.checkpoint import list_checkpoints, load_checkpoint_dir, save_checkpoint_dir
from reprlab.runs.environment import environment_record, resolve_device
from reprlab.runs.folder import (
    FolderState,
    Replacement,
    check_out_folder,
    leftovers_of_overwrite,
    refuse_if_being_replaced,
)
from reprlab.runs.lock import RunLock
from reprlab.runs.resume import prepare_resume, resolve_resume_from

T = TypeVar("T")


RunExistsError = RunFolderError  # the name older code catches


def config_differences(a: Any, b: Any, path: str = "", width: int | None = None) -> list[str]:
    """Dotted keys whose values differ between two nested config dicts, as ``key: a -> b``; each value's repr is
    cut to ``width`` characters when given."""

    def show(v: Any) -> str:
        text = repr(v)
        return text if width is None or len(text) <= width else text[: width - 3] + "..."

    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b), key=str):
            sub = f"{path}.{key}" if path else str(key)
            if key not in a or key not in b:
                out.append(f"{sub}: {show(a.get(key, '<absent>'))} -> {show(b.get(key, '<absent>'))}")
            else:
                out.extend(config_differences(a[key], b[key], sub, width))
        return out
    return [] if a == b else [f"{path}: {show(a)} -> {show(b)}"]


def _resume_mismatch(run_dir: Path, recipe: str, saved: dict, resolved: dict) -> RunFolderError:
    """The error of a ``--resume`` whose config is not the folder's: another recipe said as such, else the first
    differing keys (values cut short), with the command that made the run when ``env.json`` has it."""
    from reprlab.recipes import recipe_name_of_run

    made_by = recipe_name_of_run(run_dir)
    try:
        command = read_json(run_dir / "env.json").get("command")
    except (OSError, ValueError):
        command = None
    how = (f"it was made by `{' '.join(map(str, command))}`: run that again with --out {run_dir} --resume"
           if isinstance(command, list) and command else "resume with the same recipe and overrides")  # fmt: skip
    if made_by and made_by != recipe:
        return RunFolderError(f"--resume: {run_dir} is a run of recipe {made_by}, not {recipe}", hint=how)
    diffs = config_differences(saved, resolved, width=40)[:5]
    return RunFolderError(
        f"--resume: the config given differs from {run_dir}/config.yaml ({'; '.join(diffs)})", hint=how
    )


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
        self._lock: RunLock | None = None
        self._replacement: Replacement | None = None
        self._trackers: Any = None
        self._resume_from: str | None = None  # "<tag>/step_N" of --resume-from, until that tag is loaded

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
        resume_from: str | None = None,
    ) -> Run:
        """Create (or reopen with ``resume=True``) a run folder.

        Args:
            resume_from: with ``resume``, the checkpoint to continue from (``<tag>/step_N``) instead of
                the newest; everything written after it is set aside.

        Raises:
            RunExistsError: the folder already holds a run and neither ``resume`` nor ``overwrite`` is set.
            CheckpointError: ``resume`` and the checkpoint to continue from is damaged (nothing changed).
        """
        run_dir = Path(run_dir)
        rank = int(os.environ.get("RANK", "0"))
        device = resolve_device(getattr(cfg, "device", "auto"))
        if rank != 0:  # rank 0 owns the folder; the others only need to know where it is
            run = cls(run_dir, cfg, recipe, resume=resume, quiet=quiet, device=device)
            run._resume_from = resume_from
            return run
        if resume_from and not resume:
            raise RunFolderError("--resume-from needs --resume")
        # refuses a folder a live process writes or replaces, and every flag combination that loses results
        state = check_out_folder(run_dir, resume=resume, overwrite=overwrite)
        for old in leftovers_of_overwrite(run_dir):
            logging.getLogger("reprlab").warning(
                "%s holds the results an interrupted --overwrite of %s set aside; delete it when not needed",
                old, run_dir,
            )  # fmt: skip
        replacement = Replacement.move_aside(run_dir) if overwrite and state is FolderState.RUN else None
        if replacement is not None:
            lock = replacement.new_lock
        else:
            try:
                run_dir.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise write_error(err, run_dir) from err
            lock = RunLock.acquire(run_dir)
            try:
                refuse_if_being_replaced(run_dir)  # two-rename swaps leave a gap
            except BaseException:
                lock.release()
                raise
        run = cls(run_dir, cfg, recipe, resume=resume, quiet=quiet, device=device)
        run._lock, run._replacement = lock, replacement
        run._resume_from = resume_from
        try:
            resolved = config_to_dict(cfg)
            previous_env = None
            if run.resume:
                try:
                    saved = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
                except (yaml.YAMLError, UnicodeDecodeError) as err:
                    raise RunFolderError(f"--resume: {run_dir}/config.yaml is corrupt: {err}") from err
                if saved != resolved:
                    raise _resume_mismatch(run_dir, recipe, saved or {}, resolved)
                prepare_resume(run_dir, resume_from, run.logger)
                run._truncate_metrics_to_last_durable_event()
                if (run_dir / "env.json").exists():
                    try:
                        previous_env = read_json(run_dir / "env.json")
                    except ValueError:
                        previous_env = None
            atomic_write_text(
                run.dir / "config.yaml", f"# recipe: {recipe}\n" + yaml.safe_dump(resolved, sort_keys=False)
            )
            env = environment_record(cfg, recipe, device, argv)
            env["resumed"] = run.resume
            if previous_env is not None:  # keep where and how the run started; list every resume after it
                env["first_start"] = previous_env.get("first_start", previous_env)
                env["first_start"].pop("first_start", None)
            atomic_write_json(run.dir / "env.json", env)
        except BaseException as err:
            if run.close(success=False):
                err.reprlab_restored = run_dir  # the CLI says the old results are back, not "--resume"
            raise
        return run

    def open_trackers(self, names: tuple[str, ...]) -> None:
        """Feed TensorBoard / W&B from :meth:`log` (main rank only); a resume drops their later steps too."""
        from reprlab.runs.trackers import open_trackers

        resume_step = None
        if self.resume and self._metrics_path.exists():
            lines = self._metrics_path.read_bytes().splitlines()
            resume_step = json.loads(lines[-1]).get("step", 0) + 1 if lines else 0
        self._trackers = open_trackers(names, self.dir, self.dir.name, config_to_dict(self.cfg), resume_step)

    def close(self, success: bool) -> bool:
        """Release the folder: drop the lock; after an ``--overwrite``, delete or restore the old results.

        Returns whether an ``--overwrite``'s old results were put back (a run that did not succeed).
        """
        restored = False
        for tracker in (self._trackers,):
            if tracker is not None:
                tracker.close()
        self._trackers = None
        if self._replacement is not None:  # it holds the folder's lock and releases it
            self._replacement.commit() if success else self._replacement.rollback()
            restored = not success
            self._replacement, self._lock = None, None
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        return restored

    # ------------------------------------------------------------------ metrics and artefacts
    def _metric_lines(self) -> int:
        if not self._metrics_path.exists():
            return 0
        with open(self._metrics_path, "rb") as fh:
            return sum(1 for _ in fh)

    def _truncate_metrics_to_last_durable_event(self) -> None:
        """Cut ``metrics.jsonl`` back to the last checkpoint or finished stage.

        What follows that point (lines of steps that will be re-run, a torn last line, bytes that are not
        UTF-8 or not JSON) is dropped; a bad line *before* it is real damage and raises, naming the line.
        """
        marks = [0]
        for tag_dir in (self.dir / "checkpoints").glob("*"):
            for ckpt in list_checkpoints(tag_dir):
                marks.append(read_json(ckpt / "meta.json").get("metric_lines", 0))
        for stage in (self.dir / "stages").glob("*.json"):
            marks.append(read_json(stage).get("metric_lines", 0))
        keep = max(marks)
        if not self._metrics_path.exists():
            return
        lines = self._metrics_path.read_bytes().splitlines(keepends=True)
        for i, raw in enumerate(lines[:keep], 1):
            try:
                json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                raise RunFolderError(
                    f"--resume: {self._metrics_path}:{i} is corrupt ({err}) before the last checkpoint",
                    hint="the metrics of finished steps are damaged; start the run again with --overwrite",
                ) from None
        if len(lines) > keep or (lines[:keep] and not lines[keep - 1].endswith(b"\n")):
            kept = b"".join(lines[:keep])
            atomic_write_bytes(self._metrics_path, kept if kept.endswith(b"\n") or not kept else kept + b"\n")
            self.logger.info(
                "resume: dropped %d metric lines logged after the last checkpoint", len(lines) - keep
            )

    def log(self, step: int, **metrics: Any) -> None:
        """Append ``{"step": step, **metrics}`` to ``metrics.jsonl`` (main rank only)."""
        if not self.is_main:
            return
        line = dumps_json({"step": int(step), **metrics}, indent=None)

        def append() -> None:
            with open(self._metrics_path, "a", encoding="utf-8") as fh:
                fh.write(line + "\n")
                fh.flush()

        try:
            faults.file_op("append", self._metrics_path, append)
        except OSError as err:
            raise write_error(err, self._metrics_path) from err
        if self._trackers is not None:
            self._trackers.log(int(step), metrics)

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

    def save_sharded_checkpoint(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        replicated: dict[str, torch.nn.Module] | None = None,
        replicated_optims: dict[str, torch.optim.Optimizer] | None = None,
        extra: dict[str, Any] | None = None,
        tag: str = "train",
        keep_last: int = 2,
    ) -> Path:
        """Save an FSDP2-sharded model and its optimizer through DCP (:mod:`reprlab.runs.dcp`); every rank calls
        it. ``replicated``: modules and optimizers identical on every rank (rank 0 writes them)."""
        from reprlab.runs.dcp import save_sharded_checkpoint

        return save_sharded_checkpoint(
            self.dir / "checkpoints" / tag, step, model, optimizer, replicated, replicated_optims, extra,
            meta={"metric_lines": self._metric_lines() if self.is_main else 0, "time": time.time()},
            keep_last=keep_last,
        )  # fmt: skip

    def load_sharded_checkpoint(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        replicated: dict[str, torch.nn.Module] | None = None,
        replicated_optims: dict[str, torch.optim.Optimizer] | None = None,
        tag: str = "train",
    ) -> tuple[int, dict[str, Any]] | None:
        """Restore the latest sharded checkpoint of ``tag`` on every rank; ``None`` when there is none."""
        from reprlab.runs.dcp import load_sharded_checkpoint

        ckpts = list_checkpoints(self.dir / "checkpoints" / tag)
        if self._resume_from:
            target = resolve_resume_from(self.dir, self._resume_from)
            if target.parent.name == tag:
                ckpts, self._resume_from = [target], None
        if not ckpts:
            return None
        out = load_sharded_checkpoint(ckpts[-1], model, optimizer, replicated, replicated_optims)
        self.logger.info("resumed %s from %s (sharded)", tag, ckpts[-1])
        return out

    def load_checkpoint(
        self,
        modules: dict[str, torch.nn.Module],
        optimizers: dict[str, torch.optim.Optimizer] | None = None,
        tag: str = "train",
        restore_rng: bool = True,
    ) -> tuple[int, dict[str, Any]] | None:
        """Restore the latest checkpoint of ``tag`` (all parts or none); ``None`` when there is none.

        Raises:
            CheckpointError: the latest checkpoint is damaged or does not fit; it names the file and the
                previous intact checkpoint (``--resume-from``). There is no silent fallback.
        """
        ckpts = list_checkpoints(self.dir / "checkpoints" / tag)
        if self._resume_from:  # the named checkpoint itself: other ranks may list before rank 0 has rewound
            target = resolve_resume_from(self.dir, self._resume_from)
            if target.parent.name == tag:
                ckpts, self._resume_from = [target], None
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
            return read_stage(path)
        result = fn()
        nonfinite = nonfinite_pointers(result)  # written as null; kept here so a resume gets them back
        if self.is_main:
            atomic_write_json(path, {"result": result, "nonfinite": nonfinite,
                                     "metric_lines": self._metric_lines(), "time": time.time()})  # fmt: skip
        # Round-trip through JSON so a fresh and a resumed run see identical types (tuples become lists).
        return restore_nonfinite(json.loads(dumps_json(result, indent=None)), nonfinite)

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
        return self.save_json("summary.json", with_null_reasons(summary))
