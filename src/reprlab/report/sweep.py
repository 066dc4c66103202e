"""The report of a seed sweep: claims over seeds and the headline with every seed, then every key.

Built only from ``aggregate.json`` and ``claims.json`` in the sweep folder (written by
:func:`reprlab.sweep.write_aggregate`), so ``reprlab report DIR`` rebuilds it anywhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from reprlab.report.build import claims_section
from reprlab.report.headline import coded_counts, coded_keys, headlines_of, sweep_figure, sweep_headline
from reprlab.report.render import fmt, fmt_ci, plural, render
from reprlab.report.section import Section
from reprlab.results.aggregate import aggregated_runs
from reprlab.results.intervals import METHOD_TEXT
from reprlab.runs.atomic import read_json


def _cell(info: dict) -> str:
    if info["ci_lo"] is None:
        return f"{fmt(info['mean'])} (n=1)"
    return fmt_ci(info["mean"], info["ci_lo"], info["ci_hi"])


def _module(recipe: str):
    from reprlab.errors import ReprlabError
    from reprlab.recipes import get_recipe

    try:
        return get_recipe(recipe).module()
    except (ReprlabError, ImportError):
        return None


def _methods_text(detail: dict[str, dict[str, Any]]) -> str:
    used = sorted({info.get("ci_method", "student-t") for info in detail.values()})
    return "Intervals (95%): " + "; ".join(
        f"{m}: {METHOD_TEXT.get(m.split(' ')[0], m)}" + (" (declared proportion, values outside [0, 1])"
                                                         if "declared" in m else "")
        for m in used
    ) + ". Which keys are proportions is declared by the method (docs/reports.md)."  # fmt: skip


def sweep_sections(sweep_dir: Path) -> list[Section]:
    agg = read_json(Path(sweep_dir) / "aggregate.json")
    detail = agg["keys"]
    seeds = [str(s) for s in agg["seeds"]]
    module = _module(agg["recipe"])
    means = {k: info["mean"] for k, info in detail.items()}
    heads = headlines_of(module, means) if module is not None else []
    tables = [(f"{h.caption or 'Headline results'}: mean [95% interval] over {plural(len(seeds), 'seed')}",
               sweep_headline(h, detail)) for h in heads]  # fmt: skip
    tables = [(c, rows) for c, rows in tables if rows]
    sections = []
    claims = claims_section(sweep_dir, tables, sweep=True)
    if claims is not None:
        claims.figure = sweep_figure(heads, detail)
        if claims.figure is not None:
            claims.text += ("\n\nThe figure below the tables shows each seed's value (grey dots), the mean (bar) "
                            "and its 95% interval (whisker) for the headline keys.")  # fmt: skip
        sections.append(claims)
    rows = []
    coded = coded_keys(heads, list(detail))
    for key, info in detail.items():
        if key.startswith("claims.") or key == "wall_time_s":
            continue
        if key in coded and (text := coded_counts(coded[key], info["per_seed"])) is not None:
            row = {"metric": key, "mean [95% CI]": text, "interval": "coded (seeds per label)"}
        else:
            row = {
                "metric": key,
                "mean [95% CI]": _cell(info),
                "interval": info.get("ci_method", "student-t"),
            }
        row.update({f"seed {s}": info["per_seed"].get(s, "–") for s in seeds})
        rows.append(row)
    text = (f"{plural(len(seeds), 'seed')} ({', '.join(seeds)}) of recipe `{agg['recipe']}`. {_methods_text(detail)} "
            "Run folders: " + ", ".join(f"`{p}`" for p in agg["runs"]) + ".")  # fmt: skip
    if agg.get("failed"):
        text += " **Failed seeds (not aggregated):** " + "; ".join(
            f"{s}: {e}" for s, e in agg["failed"].items()
        )
    sections.append(Section("Every metric over seeds", text=text, table=rows, collapsed=len(rows) > 40))
    sections += _recipe_sweep_sections(aggregated_runs(Path(sweep_dir), agg), agg["recipe"])
    if "wall_time_s" in detail:
        sections.append(Section("Wall time", text=_wall_time_text(detail["wall_time_s"])))
    return sections


def _recipe_sweep_sections(run_dirs: list[Path], recipe: str) -> list[Section]:
    """Sections the recipe draws over all seeds (its entry module's ``sweep_sections(run_dirs)``), if any."""
    module = _module(recipe)
    fn = getattr(module, "sweep_sections", None) if module is not None else None
    runs = [p for p in run_dirs if p.is_dir()]
    return list(fn(runs)) if fn is not None and runs else []


def build_sweep_report(sweep_dir: Path | str) -> tuple[Path, Path]:
    sweep_dir = Path(sweep_dir)
    recipe = read_json(sweep_dir / "aggregate.json")["recipe"]
    return render(sweep_sections(sweep_dir), f"reprlab sweep: {recipe}", sweep_dir)


def _wall_time_text(info: dict[str, Any]) -> str:
    """Mean and range of the seeds' wall times: a t-interval of a positive quantity over two or three seeds
    reaches below zero ("1 [-12, 15] s"), and a time is a measurement of the machine, not an estimate."""
    times = [float(v) for v in info["per_seed"].values() if isinstance(v, int | float)]
    if len(times) < 2:
        return f"{info['mean']:.0f} s (1 seed)."
    return (f"{info['mean']:.0f} s per seed on the mean, {min(times):.0f}–{max(times):.0f} s over {len(times)} seeds "
            "(the process that wrote each summary; a resumed seed counts its resumed part only).")  # fmt: skip
