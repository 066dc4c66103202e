"""Optional metric trackers (TensorBoard, Weights & Biases) fed from the records that go to ``metrics.jsonl``.

A tracker receives exactly the dict that :meth:`reprlab.runs.Run.log` writes as one ``metrics.jsonl`` line,
minus ``"step"``. Numeric values become scalars; string values become a tag prefix, because several training
loops of one run log the same metric names told apart by a string key (``{"defense": "otcclip", "loss": 0.3}``
is logged as ``otcclip/loss``). Other values (bools, lists, ``None``) are left to ``metrics.jsonl``.

Both packages are optional (``pip install 'reprlab[track]'``) and imported only when a tracker is opened, so
a run without trackers imports neither. Only the process with ``RANK`` 0 opens trackers; the caller ensures it.

Run-folder files::

    tensorboard/      TensorBoard event files (one per process start; a resume purges steps >= resume_step)
    wandb/            W&B's own folder (offline runs: ``wandb/offline-run-<time>-<id>/``)
    wandb_id.txt      the W&B run id, so a resume continues the same W&B run
    wandb_step.txt    a bound on the W&B ``_step`` already used, so a resume never reuses one
"""

from __future__ import annotations

import importlib.util
import json
import numbers
import os
import secrets
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from reprlab.errors import ConfigError
from reprlab.runs.atomic import atomic_write_text, dumps_json

TRACKERS = ("tensorboard", "wandb")
INSTALL_HINT = "pip install 'reprlab[track]'"
# The import name each tracker needs; torch.utils.tensorboard is a thin wrapper over the tensorboard package.
_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}
# W&B's x axis for every metric: the reprlab step, logged as a metric because W&B's own ``_step`` must only
# grow, while reprlab steps may restart (one loop per defense) or repeat (records re-logged after a resume).
WANDB_STEP_KEY = "_reprlab_step"
# wandb_step.txt holds a reserved upper bound, rewritten once per this many rows instead of at every log.
_WANDB_STEP_RESERVE = 1024


class Tracker(Protocol):
    """Receives every metric record of a run."""

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Log one record: the dict written to ``metrics.jsonl``, without ``"step"``."""
        ...

    def close(self) -> None:
        """Flush and release the tracker; called once at the end of the run."""
        ...


def parse_trackers(spec: str | Sequence[str] | None) -> tuple[str, ...]:
    """Validate a tracker list given as ``"tensorboard,wandb"`` or a sequence of names.

    Args:
        spec: comma-separated names, a sequence of names, or ``None``/``""`` for none. Case and surrounding
            blanks are ignored; duplicates are dropped, first occurrence kept.

    Returns:
        The tracker names in the order given.

    Raises:
        ConfigError: a name is not one of :data:`TRACKERS`.
    """
    if spec is None:
        return ()
    parts = spec.split(",") if isinstance(spec, str) else list(spec)
    names: list[str] = []
    for part in parts:
        if not isinstance(part, str):
            raise ConfigError(
                f"tracker names must be strings, got {part!r}; valid trackers: {', '.join(TRACKERS)}"
            )
        name = part.strip().lower()
        if not name:
            continue
        if name not in TRACKERS:
            raise ConfigError(
                f"unknown tracker {part.strip()!r}; valid trackers: {', '.join(TRACKERS)}",
                hint=f"e.g. trackers={','.join(TRACKERS)}",
            )
        if name not in names:
            names.append(name)
    return tuple(names)


def check_trackers_available(names: str | Iterable[str] | None) -> None:
    """Fail early, before the run folder exists, when a tracker's package is not installed.

    Uses ``importlib.util.find_spec`` so nothing is imported (importing wandb takes about a second).

    Raises:
        ConfigError: a tracker is unknown or its package is missing; the message gives the pip command.
    """
    missing = [
        name for name in parse_trackers(_names(names)) if importlib.util.find_spec(_PACKAGES[name]) is None
    ]
    if missing:
        packages = ", ".join(_PACKAGES[name] for name in missing)
        raise ConfigError(
            f"tracker(s) {', '.join(missing)} need the package(s) {packages}, which are not installed; "
            f"run: {INSTALL_HINT}",
            hint=INSTALL_HINT,
        )


def _names(names: str | Iterable[str] | None) -> str | list[str] | None:
    # A bare string is the comma-separated spec, not an iterable of one-letter names.
    return names if names is None or isinstance(names, str) else list(names)


def _as_number(value: Any) -> float | int | None:
    """``value`` as a Python int/float, or ``None`` when it is not a real number (bools are not numbers here)."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # 0-d torch tensor or numpy array
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None  # numpy.bool_ is not registered as numbers.Real, so it lands here too
    return value if isinstance(value, int | float) else float(value)


def flatten_record(metrics: dict[str, Any]) -> dict[str, float | int]:
    """Numeric values of a record, keyed by ``"<string values joined by '/'>/<key>"``.

    >>> flatten_record({"defense": "otcclip", "loss": 0.5, "done": True, "hist": [1, 2]})
    {'otcclip/loss': 0.5}
    """
    prefix = "/".join(v for v in metrics.values() if isinstance(v, str))
    out: dict[str, float | int] = {}
    for key, value in metrics.items():
        number = _as_number(value)
        if number is not None:
            out[f"{prefix}/{key}" if prefix else str(key)] = number
    return out


def _config_text(config: dict[str, Any]) -> str:
    # Indented lines are a code block in any Markdown dialect, which is what TensorBoard's text tab renders.
    return "\n".join("    " + line for line in dumps_json(config).splitlines())


def _plain(config: dict[str, Any]) -> dict[str, Any]:
    # Paths, tuples, tensors... become JSON types, as in config.yaml, so both trackers store the same thing.
    return json.loads(dumps_json(config))


class TensorBoardTracker:
    """Writes scalars to ``run_dir/tensorboard`` with ``torch.utils.tensorboard.SummaryWriter``."""

    def __init__(self, run_dir: Path, config: dict[str, Any], resume_step: int | None):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step makes readers drop every event at step >= resume_step written before this restart, like
        # the metrics.jsonl lines after the last checkpoint. TensorBoard purges across all tags at once.
        self._writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"), purge_step=resume_step)
        if not resume_step:  # a resume from step > 0 keeps the step-0 config text written by the first start
            self._writer.add_text("config", _config_text(config), global_step=0)
            self._writer.flush()

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for tag, value in flatten_record(metrics).items():
            self._writer.add_scalar(tag, value, global_step=int(step))
        # Flush each record so a killed run keeps in TensorBoard what it kept in metrics.jsonl (default: 2 min).
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    """Logs to a Weights & Biases run, offline unless ``WANDB_MODE`` says otherwise.

    Every row carries the reprlab step as ``_reprlab_step``, the x axis of every metric; W&B's own ``_step``
    is a counter that only grows, so a loop that restarts its steps, or records logged again after a resume,
    are all kept (W&B drops a row whose explicit step is lower than the last one, with only a warning).
    The counter continues across resumes via ``wandb_step.txt``: W&B cannot resume an offline run, each
    start writes its own ``offline-run-*`` folder under the same id, and ``wandb sync --append`` joins them
    only when their ``_step`` ranges are disjoint.
    """

    def __init__(self, run_dir: Path, run_name: str, config: dict[str, Any], resume_step: int | None):
        import wandb

        run_dir = Path(run_dir)
        self._step_file = run_dir / "wandb_step.txt"
        id_file = run_dir / "wandb_id.txt"
        resuming = resume_step is not None
        run_id = id_file.read_text(encoding="utf-8").strip() if resuming and id_file.exists() else ""
        if not run_id:
            # A fresh run gets a fresh id, even if an old wandb_id.txt is around, so runs never share one.
            run_id = secrets.token_hex(4)
            atomic_write_text(id_file, run_id + "\n")
            atomic_write_text(self._step_file, "0\n")
        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "reprlab"),
            name=run_name,
            dir=str(run_dir),
            config=_plain(config),
            mode=os.environ.get("WANDB_MODE", "offline"),
            id=run_id,
            resume="allow",
            # Without it wandb.init returns the previous unfinished run of this process (e.g. the last seed of
            # a sweep) instead of starting this one.
            reinit="create_new",
        )
        self._run.define_metric(WANDB_STEP_KEY)
        self._run.define_metric("*", step_metric=WANDB_STEP_KEY)
        # Online, W&B knows where the resumed run stopped (starting_step); offline it starts at 0 again.
        self._next = max(self._read_step(), int(getattr(self._run, "starting_step", 0) or 0))
        self._reserved = self._next
        self._closed = False

    def _read_step(self) -> int:
        try:
            return int(self._step_file.read_text(encoding="utf-8").strip())
        except (OSError, ValueError):
            return 0

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row: dict[str, Any] = {WANDB_STEP_KEY: int(step), **flatten_record(metrics)}
        if self._next >= self._reserved:
            # Reserve a block of W&B steps before using it, so a killed run's successor starts past every step
            # this one may have written, at one small file write per block.
            self._reserved = self._next + _WANDB_STEP_RESERVE
            atomic_write_text(self._step_file, f"{self._reserved}\n")
        self._run.log(row, step=self._next)
        self._next += 1

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._run.finish()
        atomic_write_text(self._step_file, f"{self._next}\n")


class MultiTracker:
    """Fans every record out to the open trackers; with none it does nothing."""

    def __init__(self, trackers: Sequence[Tracker] = ()):
        self.trackers: tuple[Tracker, ...] = tuple(trackers)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Send one record (the ``metrics.jsonl`` dict without ``"step"``) to every tracker."""
        if "step" in metrics:  # the caller passes the jsonl dict; the step is an argument, not a metric
            metrics = {k: v for k, v in metrics.items() if k != "step"}
        for tracker in self.trackers:
            tracker.log(step, metrics)

    def close(self) -> None:
        """Close every tracker, even when one fails; the first failure is raised afterwards."""
        trackers, self.trackers = self.trackers, ()
        error: BaseException | None = None
        for tracker in trackers:
            try:
                tracker.close()
            except BaseException as err:  # re-raised below, once the others are closed
                error = error or err
        if error is not None:
            raise error

    def __enter__(self) -> MultiTracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_trackers(
    names: str | Iterable[str] | None,
    run_dir: Path,
    run_name: str,
    config: dict[str, Any],
    resume_step: int | None,
) -> MultiTracker:
    """Open the named trackers for a run folder.

    Args:
        names: tracker names (validated with :func:`parse_trackers`); empty opens none and imports nothing.
        run_dir: the run folder; each tracker writes below it.
        run_name: the run's display name (W&B ``name``).
        config: the resolved config, stored by each tracker (TensorBoard text ``config``, W&B config).
        resume_step: the step the run resumes from (the last durable checkpoint), or ``None`` for a fresh
            run. TensorBoard drops its events at steps >= ``resume_step``; W&B continues the same run id.

    Returns:
        A :class:`MultiTracker`; close it at the end of the run.
    """
    opened: list[Tracker] = []
    try:
        for name in parse_trackers(_names(names)):
            if name == "tensorboard":
                opened.append(TensorBoardTracker(run_dir, config, resume_step))
            else:
                opened.append(WandbTracker(run_dir, run_name, config, resume_step))
    except BaseException:
        MultiTracker(opened).close()  # do not leave a writer or a W&B process behind
        raise
    return MultiTracker(opened)


__all__ = [
    "TRACKERS",
    "MultiTracker",
    "TensorBoardTracker",
    "Tracker",
    "WandbTracker",
    "check_trackers_available",
    "flatten_record",
    "open_trackers",
    "parse_trackers",
]
