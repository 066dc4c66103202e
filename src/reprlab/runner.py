"""Run one recipe end to end: config -> run folder -> the method's ``run`` -> summary -> report.

Shared by the CLI (``reprlab run``) and the demo, which is why it lives outside ``cli.py``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path

from reprlab.jsonfile import with_null_reasons
from reprlab.quiet import third_party_quiet
from reprlab.recipes import get_recipe
from reprlab.results.claims import record_claims
from reprlab.runs import faults


def _default_out(name: str) -> Path:
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")  # same on every torchrun rank, so ranks share one folder
    stamp = run_id if run_id and run_id != "none" else time.strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{name}-{stamp}"


def execute(
    recipe_name: str,
    overrides: list[str] | tuple[str, ...] = (),
    out: Path | None = None,
    resume: bool = False,
    overwrite: bool = False,
    quiet: bool = False,
    demo: bool = False,
    track: str | list[str] | tuple[str, ...] | None = None,
    resume_from: str | None = None,
) -> Path:
    """Run a recipe end to end (config → run folder → ``run`` → summary → report); returns the run folder.

    Args:
        track: metric trackers fed from the same records as ``metrics.jsonl`` (``tensorboard``, ``wandb``);
            default from ``REPRLAB_TRACK``.
        resume_from: with ``resume``, continue from this checkpoint (``<tag>/step_N``) instead of the newest.

    Third-party FutureWarnings and INFO logs are kept out of the run's output (:mod:`reprlab.quiet`;
    ``REPRLAB_VERBOSE=1`` or ``reprlab -v`` shows them).
    """
    with third_party_quiet():
        return _execute(recipe_name, overrides, out, resume, overwrite, quiet, demo, track, resume_from)


def _execute(
    recipe_name: str,
    overrides: list[str] | tuple[str, ...],
    out: Path | None,
    resume: bool,
    overwrite: bool,
    quiet: bool,
    demo: bool,
    track: str | list[str] | tuple[str, ...] | None,
    resume_from: str | None,
) -> Path:
    from reprlab.runs import Run
    from reprlab.runs.environment import resolve_device
    from reprlab.runs.runlog import run_log

    recipe = get_recipe(recipe_name)
    all_overrides = [*(recipe.demo if demo else ()), *overrides]
    cfg = recipe.build_config(all_overrides)
    claims = recipe.claims()
    module = recipe.module()
    # Everything that can be checked without work (devices, trackers, models and files reachable) is checked
    # before a folder exists, so a bad input never leaves a half-made run folder behind.
    resolve_device(getattr(cfg, "device", "auto"))
    trackers = _trackers(track)
    preflight = getattr(module, "preflight", None)
    if preflight is not None:
        preflight(cfg)
    out = Path(out) if out is not None else _default_out(recipe.name + ("-demo" if demo else ""))
    with _run_threads(getattr(cfg, "threads", 0)):  # set before env.json records the count: the run's own
        run = Run.create(out, cfg, recipe.name, resume=resume, overwrite=overwrite, quiet=quiet,
                         argv=["reprlab", "run", recipe_name, *all_overrides], resume_from=resume_from)  # fmt: skip
        try:
            with run_log(run.dir, resumed=resume, enabled=run.is_main):
                _run_body(run, module, cfg, claims, trackers, demo)
        except BaseException as err:
            if run.close(success=False):
                err.reprlab_restored = run.dir  # the CLI says the old results are back, not "--resume"
            raise
        run.close(success=True)
    return run.dir


@contextlib.contextmanager
def _run_threads(threads: object):
    """A recipe's ``threads`` (> 0) for the whole run, the caller's count restored after."""
    import torch

    previous = torch.get_num_threads()
    if isinstance(threads, int) and not isinstance(threads, bool) and threads > 0:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _run_body(run, module, cfg, claims, trackers, demo: bool) -> None:
    """Trackers, seeding, the method's ``run``, then summary, claims and report (the main rank writes)."""
    from reprlab.report.build import build_report
    from reprlab.train.seed import seed_everything

    if trackers and run.is_main:
        run.open_trackers(trackers)
    seed_everything(getattr(cfg, "seed", 0), rank=run.rank)
    logging.getLogger("reprlab").info("run folder: %s", run.dir)
    t0 = time.time()
    summary = module.run(cfg, run)
    if run.is_main:
        summary = with_null_reasons(
            summary or {}
        )  # NaN -> null + reason, so a claim on it says why it is n/a
        summary.setdefault("wall_time_s", round(time.time() - t0, 1))
        if demo:
            summary.setdefault("variant", "demo")
        summary.update(record_claims(run.dir, claims, summary))
        run.write_summary(summary)
        with faults.group("report"):
            build_report(run.dir)
        logging.getLogger("reprlab").info("summary, claims and report written to %s", run.dir)


def _trackers(track: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    spec = track if track is not None else os.environ.get("REPRLAB_TRACK", "")
    if not spec:
        return ()
    from reprlab.runs.trackers import check_trackers_available, parse_trackers

    names = parse_trackers(spec)
    check_trackers_available(names)
    return names
