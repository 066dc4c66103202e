"""Run one recipe end to end: config -> run folder -> the method's ``run`` -> summary -> report.

Shared by the CLI (``reprlab run``) and the demo, which is why it lives outside ``cli.py``.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from reprlab.recipes import get_recipe
from reprlab.results.claims import record_claims


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
) -> Path:
    """Run a recipe end to end (config → run folder → ``run`` → summary → report); returns the run folder."""
    from reprlab.report.build import build_report
    from reprlab.runs import Run
    from reprlab.train.seed import seed_everything

    recipe = get_recipe(recipe_name)
    all_overrides = [*(recipe.demo if demo else ()), *overrides]
    cfg = recipe.build_config(all_overrides)
    module = recipe.module()
    # Checks that need no work (devices, models and files reachable) run before a folder exists, so a bad
    # input never leaves a half-made run folder behind.
    preflight = getattr(module, "preflight", None)
    if preflight is not None:
        preflight(cfg)
    out = Path(out) if out is not None else _default_out(recipe.name + ("-demo" if demo else ""))
    run = Run.create(out, cfg, recipe.name, resume=resume, overwrite=overwrite, quiet=quiet,
                     argv=["reprlab", "run", recipe_name, *all_overrides])  # fmt: skip
    seed_everything(getattr(cfg, "seed", 0), rank=run.rank)
    logging.getLogger("reprlab").info("run folder: %s", run.dir)
    t0 = time.time()
    summary = module.run(cfg, run)
    if run.is_main:
        summary = dict(summary or {})
        summary.setdefault("wall_time_s", round(time.time() - t0, 1))
        if demo:
            summary.setdefault("variant", "demo")
        summary.update(record_claims(run.dir, recipe.claims(), summary))
        run.write_summary(summary)
        build_report(run.dir)
    return run.dir
