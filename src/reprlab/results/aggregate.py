"""Aggregate finished run folders that differ only in their seed: mean, spread and a 95 % interval per key.

The interval depends on what the key measures (:mod:`reprlab.results.intervals`): Student's t for means of
continuous metrics, Wilson score intervals for proportions (declared by the recipe's ``SUMMARY_KINDS``) and
for the share of seeds on which a claim holds. Each key's method is written beside it as ``K.ci_method``.
With one seed there is no interval (``ci_lo``/``ci_hi`` are ``null``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from reprlab.errors import RunFolderError
from reprlab.results import intervals
from reprlab.runs.atomic import read_json
from reprlab.runs.folder import FolderState, folder_state

INTERVAL = (
    "95% intervals over seeds: Student t for means of continuous metrics; Wilson score intervals for "
    "proportions (at the effective sample size) and for the share of seeds on which a claim holds; "
    "each key's method is in <key>.ci_method; null when n < 2"
)


@dataclass(frozen=True)
class SeedRun:
    """One finished run folder of a sweep."""

    path: Path
    recipe: str
    seed: int | None
    config: dict[str, Any]
    summary: dict[str, Any]


def t_interval(
    values: Sequence[float], level: float = 0.95
) -> tuple[float, float, float | None, float | None]:
    """``(mean, sd, lo, hi)`` of the Student t interval of the mean; ``lo``/``hi`` are ``None`` for n < 2."""
    res = intervals.t_interval(values, level)
    return res.mean, res.sd, res.lo, res.hi


def read_seed_run(path: Path) -> SeedRun:
    """Read a finished run folder; errors name the folder and what is missing."""
    path = Path(path)
    if folder_state(path) is not FolderState.RUN:
        raise RunFolderError(f"{path} is not a reprlab run folder (no config.yaml starting with '# recipe:')")
    if not (path / "summary.json").is_file():
        raise RunFolderError(
            f"{path} is not finished (no summary.json)",
            hint=f"finish it with `reprlab run ... --out {path} --resume`",
        )
    text = (path / "config.yaml").read_text(encoding="utf-8")
    recipe = text.splitlines()[0].split(":", 1)[1].strip()
    try:
        config = yaml.safe_load(text) or {}
        summary = read_json(path / "summary.json")
    except (yaml.YAMLError, ValueError) as err:
        raise RunFolderError(f"{path}: cannot read its config or summary: {err}") from err
    seed = config.get("seed")
    return SeedRun(path, recipe, seed if isinstance(seed, int) else None, config, summary)


def stored_run_path(out: Path, run: Path) -> str:
    """How ``aggregate.json`` names a run [ours]: a run inside the aggregate's folder (a sweep's seeds) relative to
    it, so the sweep moves or copies as one; any other run by its absolute path, which holds from any directory
    and after the aggregate moves alone (the command's own relative names held only from where it ran)."""
    run, out = Path(os.path.abspath(run)), Path(os.path.abspath(out))  # symlinked run folders stay as named
    return run.relative_to(out).as_posix() if run.is_relative_to(out) else str(run)


def aggregated_runs(out: Path, agg: Mapping[str, Any]) -> list[Path]:
    """The run folders an ``aggregate.json`` in ``out`` names. Older files named them relative to the directory
    the aggregate ran in; such a name is taken as it is when it does not resolve from ``out``."""
    found = []
    for name in agg.get("runs", []):
        beside = Path(out) / name
        found.append(beside if beside.is_dir() or not Path(name).is_dir() else Path(name))
    return found


def expand_run_folders(paths: Sequence[Path]) -> list[Path]:
    """Run folders named directly, plus the run folders inside a sweep or any other folder given."""
    out: list[Path] = []
    for p in map(Path, paths):
        state = folder_state(p)
        if state is FolderState.RUN:
            out.append(p)
        elif state in (FolderState.SWEEP, FolderState.FOREIGN):
            found = sorted((c for c in p.iterdir() if folder_state(c) is FolderState.RUN), key=_seed_order)
            if not found:
                raise RunFolderError(f"{p} holds no run folders")
            out.extend(found)
        else:
            raise RunFolderError(f"{p} does not exist" if state is FolderState.MISSING else f"{p} is empty")
    return out


def _seed_order(p: Path) -> tuple[int, str]:
    tail = p.name.rsplit("-", 1)[-1]
    return (int(tail), p.name) if tail.isdigit() else (1 << 30, p.name)


def check_same_setting(runs: Sequence[SeedRun]) -> None:
    """Refuse runs whose recipe or config differ in anything but the seed, naming the difference."""
    from reprlab.runs.run import config_differences

    first = runs[0]
    for r in runs[1:]:
        if r.recipe != first.recipe:
            raise RunFolderError(f"{r.path} is recipe {r.recipe!r} but {first.path} is {first.recipe!r}")
        a = {k: v for k, v in first.config.items() if k != "seed"}
        b = {k: v for k, v in r.config.items() if k != "seed"}
        diff = config_differences(a, b)
        if diff:
            raise RunFolderError(
                f"{r.path} differs from {first.path} in more than the seed: {'; '.join(diff[:5])}",
                hint="aggregate only runs of one setting; use separate `reprlab aggregate` calls per setting",
            )
    seeds = [r.seed for r in runs]
    dupes = sorted({s for s in seeds if s is not None and seeds.count(s) > 1})
    if dupes:
        paths = [str(r.path) for r in runs if r.seed in dupes]
        raise RunFolderError(f"seed(s) {dupes} appear more than once: {', '.join(paths)}")


def aggregate_summaries(
    runs: Sequence[SeedRun], kinds: Mapping[str, str] | None = None
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """``(flat aggregate summary, per-key detail)``.

    For every numeric key ``K`` present in every run: ``K`` (mean), ``K.std``, ``K.ci_lo``, ``K.ci_hi``,
    ``K.n`` and ``K.ci_method``. A key present in only some runs is aggregated over those (its ``K.n`` says
    how many). A string key is kept when every run agrees on it. ``claims.<name>`` means become the share of
    seeds where it held.

    Args:
        kinds: ``{fnmatch pattern: kind}`` from the recipe (``SUMMARY_KINDS``); picks each key's interval.
    """
    keys: list[str] = []
    for r in runs:
        keys.extend(k for k in r.summary if k not in keys)
    flat: dict[str, Any] = {}
    detail: dict[str, dict[str, Any]] = {}
    for key in keys:
        vals = [(r.seed, r.summary[key]) for r in runs if key in r.summary]
        nums = [v for _, v in vals if isinstance(v, int | float) and not isinstance(v, bool)]
        undefined = [v for _, v in vals if v is None]  # written as null: not a finite number on that seed
        if nums and len(nums) + len(undefined) == len(vals):
            finite = [float(v) for v in nums if math.isfinite(v)]
            if not finite:
                continue
            res = intervals.interval(finite, intervals.kind_of(key, kinds))
            flat.update({key: res.mean, f"{key}.std": res.sd, f"{key}.ci_lo": res.lo, f"{key}.ci_hi": res.hi,
                         f"{key}.n": res.n, f"{key}.ci_method": res.method})  # fmt: skip
            detail[key] = {"mean": res.mean, "std": res.sd, "ci_lo": res.lo, "ci_hi": res.hi, "n": res.n,
                           "ci_method": res.method, "per_seed": {str(s): v for s, v in vals}}  # fmt: skip
        elif len({str(v) for _, v in vals}) == 1 and len(vals) == len(runs):
            flat[key] = vals[0][1]
    flat["seeds.n"] = len(runs)
    return flat, detail
