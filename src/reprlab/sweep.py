"""Seed sweeps: one ordinary run folder per seed under ``DIR/seed-<s>/``, and an aggregate in ``DIR/``.

``reprlab run RECIPE --seeds 0,1,2 --out DIR`` runs the seeds one after another (or, with a submitit
launcher, as one job each on Slurm or local processes), skips seeds that finished, resumes an interrupted one
with ``--resume``, then writes ``DIR/summary.json`` (mean, sd, 95 % t interval and n of every numeric key),
``DIR/aggregate.json`` (every seed's value), ``DIR/claims.json`` and ``DIR/report.{html,md}``.
``reprlab aggregate`` builds the same from run folders made anywhere.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from reprlab.errors import ConfigError, ReprlabError, RunFolderError
from reprlab.results.aggregate import (
    INTERVAL,
    SeedRun,
    aggregate_summaries,
    check_same_setting,
    read_seed_run,
    stored_run_path,
)
from reprlab.results.claims import Claim, claim_summary_keys, claims_table, evaluate_claims
from reprlab.runs import faults
from reprlab.runs.atomic import atomic_write_json, read_json, remove_temporaries
from reprlab.runs.folder import FolderState, Replacement, folder_state, is_finished
from reprlab.runs.lock import RunLock

log = logging.getLogger(__name__)
LAUNCHERS = ("inline", "submitit-local", "submitit-slurm")


def parse_seeds(spec: str) -> list[int]:
    """``"0,1,2"`` or ``"0-4"`` (inclusive) or a mix → sorted unique seeds."""
    seeds: list[int] = []
    try:
        for part in (p.strip() for p in spec.split(",") if p.strip()):
            if "-" in part[1:]:
                lo, hi = part.split("-", 1) if not part.startswith("-") else (part, part)
                seeds.extend(range(int(lo), int(hi) + 1))
            else:
                seeds.append(int(part))
    except ValueError:
        raise ConfigError(f"--seeds {spec!r}: expected integers like 0,1,2 or a range like 0-4") from None
    if not seeds:
        raise ConfigError(f"--seeds {spec!r} names no seed")
    return sorted(set(seeds))


def seed_dir(sweep_dir: Path, seed: int) -> Path:
    return Path(sweep_dir) / f"seed-{seed}"


def _run_one_seed(recipe: str, overrides: list[str], out: str, resume: bool, quiet: bool, demo: bool,
                  track: str) -> str:  # fmt: skip
    """One seed in this process; module-level so a submitit job can pickle it."""
    import os

    from reprlab.runner import execute

    if quiet:
        os.environ["REPRLAB_QUIET"] = "1"
    return str(
        execute(recipe, overrides, Path(out), resume=resume, quiet=quiet, demo=demo, track=track or None)
    )


def run_sweep(
    recipe_name: str,
    seeds: Sequence[int],
    overrides: Sequence[str] = (),
    out: Path | None = None,
    resume: bool = False,
    overwrite: bool = False,
    quiet: bool = False,
    demo: bool = False,
    track: str | None = None,
    launcher: str = "inline",
    launcher_opts: dict[str, Any] | None = None,
) -> Path:
    """Run ``recipe_name`` once per seed and aggregate; returns the sweep folder.

    Raises:
        ConfigError: ``seed=`` among the overrides, an unknown launcher, or a bad config (checked once,
            before any seed runs).
        RunFolderError: ``out`` holds something else, or a sweep of another setting.
    """
    from reprlab.recipes import get_recipe

    if any(o.split("=", 1)[0].strip() == "seed" for o in overrides):
        raise ConfigError("--seeds and a seed=... override contradict each other; drop seed=")
    if launcher not in LAUNCHERS:
        raise ConfigError(f"--launcher {launcher!r}: expected one of {', '.join(LAUNCHERS)}")
    recipe = get_recipe(recipe_name)
    base = [*(recipe.demo if demo else ()), *overrides]
    cfgs = {s: recipe.build_config([*base, f"seed={s}"]) for s in seeds}  # every seed's config valid up front
    recipe.claims()
    preflight = getattr(recipe.module(), "preflight", None)
    if preflight is not None:
        preflight(cfgs[seeds[0]])
    out = (
        Path(out)
        if out is not None
        else Path("runs") / f"{recipe.name}-seeds-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    marker = {"recipe": recipe.name, "overrides": list(overrides), "demo": demo}

    if int(os.environ.get("RANK", "0")) != 0:
        # under torchrun every rank takes part in each seed's run; only rank 0 owns folders and the aggregate
        for s, res in _plan(out, seeds, cfgs, resume):
            _run_one_seed(recipe.name, [*base, f"seed={s}"], str(seed_dir(out, s)), res, True, demo, "")
        return out
    state = folder_state(out)
    replacement = None
    if state is FolderState.SWEEP:
        old = read_json(out / "sweep.json")
        same = {k: old.get(k) for k in marker} == marker
        if overwrite:
            replacement = Replacement.move_aside(out)
        elif not resume:
            raise RunFolderError(f"{out} already holds a seed sweep",
                                 hint="pass --resume to finish it (or add seeds), --overwrite to replace it")  # fmt: skip
        elif not same:
            raise RunFolderError(
                f"--resume: {out} is a sweep of {old.get('recipe')} with overrides {old.get('overrides')} "
                f"(demo={old.get('demo')}), not {recipe.name} with {list(overrides)} (demo={demo})"
            )
        else:
            seeds = sorted(set(seeds) | set(old.get("seeds", [])))
            cfgs.update({s: recipe.build_config([*base, f"seed={s}"]) for s in seeds if s not in cfgs})
    elif state is FolderState.RUN:
        raise RunFolderError(f"--out {out} is a single run folder, not a sweep", hint="choose another --out")
    elif state is FolderState.FOREIGN:
        raise RunFolderError(f"--out {out} is a non-empty folder that is not a reprlab sweep; reprlab will not "
                             "write into it", hint="choose a new or empty folder")  # fmt: skip
    elif resume:
        raise RunFolderError(f"--resume: {out} does not exist" if state is FolderState.MISSING
                             else f"--resume: {out} is empty", hint="drop --resume to start the sweep")  # fmt: skip

    try:
        out.mkdir(parents=True, exist_ok=True)
        with RunLock.acquire(out):
            remove_temporaries(out, recursive=False)  # of an aggregate write a kill interrupted
            atomic_write_json(out / "sweep.json", {**marker, "seeds": list(seeds), "launcher": launcher})
            plan = _plan(out, seeds, cfgs, resume)
            failures = _launch(
                plan, recipe.name, base, out, quiet, demo, track, launcher, launcher_opts or {}
            )
            runs = [read_seed_run(seed_dir(out, s)) for s in seeds if is_finished(seed_dir(out, s))]
            if runs:
                write_aggregate(out, runs, recipe.claims(), failed=failures)
        if failures:
            detail = "; ".join(f"seed {s}: {e}" for s, e in failures.items())
            raise ReprlabError(f"{len(failures)} of {len(seeds)} seeds failed ({detail})",
                               hint=f"fix the cause, then `reprlab run {recipe.name} --seeds ... --out {out} "
                                    "--resume` re-runs only those seeds")  # fmt: skip
    except BaseException as err:
        if replacement is not None:
            replacement.rollback()
            err.reprlab_restored = out  # the CLI says the old sweep is back, not "--resume"
        raise
    if replacement is not None:
        replacement.commit()
    return out


def _plan(out: Path, seeds: Sequence[int], cfgs: dict[int, Any], resume: bool) -> list[tuple[int, bool]]:
    """``(seed, resume?)`` for the seeds still to run; finished seeds of the same config are skipped."""
    from reprlab.config import config_to_dict
    from reprlab.runs.run import config_differences

    plan = []  # (seed, resume?) for the seeds still to run
    for s in seeds:
        d = seed_dir(out, s)
        st = folder_state(d)
        if st is FolderState.RUN:
            saved = read_seed_run(d).config if is_finished(d) else None
            if saved is not None:
                diff = config_differences(saved, config_to_dict(cfgs[s]))
                if diff:
                    raise RunFolderError(f"{d} was run with another config: {'; '.join(diff[:5])}")
                log.info("seed %d already finished in %s; skipping", s, d)
                continue
            if not resume:
                raise RunFolderError(f"{d} holds an unfinished run", hint="pass --resume to continue it")
            plan.append((s, True))
        elif st is FolderState.MISSING or st is FolderState.EMPTY:
            plan.append((s, False))
        else:
            raise RunFolderError(f"{d} is not a reprlab run folder; move it out of the sweep")
    return plan


def _launch(plan, recipe, base, out, quiet, demo, track, launcher, opts) -> dict[int, str]:
    """Run the planned seeds; returns ``{seed: error}`` for those that failed (the others still run)."""
    failures: dict[int, str] = {}
    if not plan:
        return failures
    if launcher == "inline":
        for s, res in plan:
            log.info("seed %d -> %s", s, seed_dir(out, s))
            try:
                _run_one_seed(
                    recipe, [*base, f"seed={s}"], str(seed_dir(out, s)), res, quiet, demo, track or ""
                )
            except ReprlabError:
                raise  # an input error hits every seed alike: stop at once
            except Exception as err:  # a crash in one seed must not lose the others
                log.error("seed %d failed: %s", s, err)
                failures[s] = f"{type(err).__name__}: {err}"
        return failures
    try:
        import submitit
    except ImportError:
        raise ConfigError(
            f"--launcher {launcher} needs submitit", hint="pip install 'reprlab[sweep]'"
        ) from None
    cluster = "local" if launcher == "submitit-local" else "slurm"
    executor = submitit.AutoExecutor(folder=str(out / "submitit" / "%j"), cluster=cluster)
    executor.update_parameters(name=f"reprlab-{recipe}", **opts)
    jobs = []
    for s, res in plan:  # one job per seed, so a cluster runs them side by side
        args = (recipe, [*base, f"seed={s}"], str(seed_dir(out, s)), res, True, demo, track or "")
        jobs.append((s, executor.submit(_run_one_seed, *args)))
        log.info("seed %d submitted as job %s", s, jobs[-1][1].job_id)
    for s, job in jobs:
        try:
            job.result()
        except Exception as err:  # submitit re-raises the job's exception (or a FailedJobError)
            failures[s] = (
                f"{type(err).__name__}: {str(err).strip().splitlines()[-1] if str(err).strip() else ''}"
            )
            log.error("seed %d (job %s) failed: %s", s, job.job_id, failures[s])
    return failures


def write_aggregate(out: Path, runs: Sequence[SeedRun], claims: Sequence[Claim],
                    failed: dict[int, str] | None = None) -> Path:  # fmt: skip
    """Write ``summary.json``, ``aggregate.json``, ``claims.json`` and the report into ``out``."""
    check_same_setting(runs)
    with faults.group("aggregate"):
        return _write_aggregate(out, runs, claims, failed)


def _with_claims(run: SeedRun, claims: Sequence[Claim]) -> SeedRun:
    """``run`` with its ``claims.<name>`` keys re-evaluated from its own metrics against ``claims``.

    A run folder stores the verdicts of the claims its recipe declared when it ran; a claim declared or reworded
    since would otherwise be reported on the mean as now stated and "on seeds" as then stated. Without ``claims``
    (the recipe is not installed here) the stored verdicts stay.
    """
    if not claims:
        return run
    metrics = {k: v for k, v in run.summary.items() if not k.startswith("claims.")}
    return dataclasses.replace(
        run, summary={**metrics, **claim_summary_keys(evaluate_claims(claims, metrics))}
    )


def _write_aggregate(out: Path, runs: Sequence[SeedRun], claims: Sequence[Claim],
                     failed: dict[int, str] | None) -> Path:  # fmt: skip
    from reprlab.report.sweep import build_sweep_report

    runs = [_with_claims(r, claims) for r in runs]
    flat, detail = aggregate_summaries(runs, _summary_kinds(runs[0].recipe))
    on_mean = evaluate_claims(claims, {k: v for k, v in flat.items() if not k.startswith("claims.")})
    seed_share = {c.name: detail[f"claims.{c.name}"] for c in claims if f"claims.{c.name}" in detail}
    flat.update(claim_summary_keys(on_mean, prefix="claims_on_mean."))
    atomic_write_json(out / "summary.json", flat)
    atomic_write_json(out / "aggregate.json", {
        "recipe": runs[0].recipe, "interval": INTERVAL, "seeds": [r.seed for r in runs],
        "runs": [stored_run_path(out, r.path) for r in runs], "failed": {str(k): v for k, v in (failed or {}).items()},
        "keys": detail,
    })  # fmt: skip
    atomic_write_json(out / "claims.json", {"claims": claims_table(on_mean, seed_share=seed_share)})
    build_sweep_report(out)
    return out / "summary.json"


def _summary_kinds(recipe: str) -> dict[str, str]:
    """The recipe's declared summary-key kinds (proportions get Wilson intervals); none when not installed."""
    from reprlab.recipes import get_recipe

    try:
        return get_recipe(recipe).summary_kinds()
    except (ReprlabError, ImportError):
        log.warning("recipe %s is not installed here; every key gets the t interval", recipe)
        return {}


def aggregate_folders(paths: Sequence[Path], out: Path | None = None) -> Path:
    """``reprlab aggregate``: the sweep summary of run folders made anywhere; returns the output folder."""
    from reprlab.recipes import get_recipe
    from reprlab.results.aggregate import expand_run_folders

    folders = expand_run_folders(paths)
    runs = [read_seed_run(p) for p in folders]
    check_same_setting(runs)
    if out is None:
        if len(paths) == 1 and folder_state(paths[0]) in (FolderState.SWEEP, FolderState.FOREIGN):
            out = Path(paths[0])
        else:
            # one run folder is no place for an aggregate (its files are the run's); several need a home
            what = "a run folder" if len(paths) == 1 else "several folders"
            raise ConfigError(f"{what} given: pass --out for the aggregate's own folder")
    out = Path(out)
    _check_aggregate_out(out, paths, folders)
    out.mkdir(parents=True, exist_ok=True)
    try:
        claims = get_recipe(runs[0].recipe).claims()
    except ReprlabError:
        log.warning("recipe %s is not installed here; aggregating without its claims", runs[0].recipe)
        claims = ()
    with RunLock.acquire(out):
        remove_temporaries(out, recursive=False)
        marker = out / "sweep.json"
        if not marker.exists() or "aggregated_from" in read_json(marker):  # a sweep's own marker stays
            atomic_write_json(
                marker, {"recipe": runs[0].recipe, "aggregated_from": [str(p) for p in folders]}
            )
        write_aggregate(out, runs, claims)
    return out


def _check_aggregate_out(out: Path, paths: Sequence[Path], folders: Sequence[Path]) -> None:
    """Refuse an aggregate ``--out`` whose files are not the aggregate's to replace: a run folder, a folder of
    someone's files, or the sweep of ``reprlab run --seeds`` given runs other than its own seeds (its summary
    would then describe runs its ``sweep.json`` and ``seed-*`` folders do not).

    Raises:
        RunFolderError: naming the folder and why.
    """
    st = folder_state(out)
    if st is FolderState.RUN:
        raise RunFolderError(f"--out {out} is a run folder; the aggregate needs its own folder")
    if st is FolderState.FOREIGN and not (len(paths) == 1 and Path(paths[0]).resolve() == out.resolve()):
        raise RunFolderError(f"--out {out} is a non-empty folder that is not a reprlab aggregate; reprlab will not "
                             "write into it", hint="choose a new or empty folder")  # fmt: skip
    if st is FolderState.SWEEP and "aggregated_from" not in read_json(out / "sweep.json"):
        home = out.resolve()
        if any(home not in Path(f).resolve().parents for f in folders):
            raise RunFolderError(f"--out {out} is the seed sweep of `reprlab run --seeds`; aggregating other runs "
                                 "into it would mix their results with its own", hint="choose a new or empty folder")  # fmt: skip


__all__ = ["LAUNCHERS", "aggregate_folders", "parse_seeds", "run_sweep", "seed_dir", "write_aggregate"]
