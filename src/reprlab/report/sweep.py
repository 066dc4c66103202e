"""The report of a seed sweep: claims over seeds, then every key as mean ± CI with each seed's value.

Built only from ``aggregate.json`` and ``claims.json`` in the sweep folder (written by
:func:`reprlab.sweep.write_aggregate`), so ``reprlab report DIR`` rebuilds it anywhere.
"""

from __future__ import annotations

from pathlib import Path

from reprlab.report.build import claims_section
from reprlab.report.render import fmt, render
from reprlab.report.section import Section
from reprlab.runs.atomic import read_json


def _cell(info: dict) -> str:
    if info["ci_lo"] is None:
        return f"{fmt(info['mean'])} (n=1)"
    return f"{fmt(info['mean'])} ± {fmt((info['ci_hi'] - info['ci_lo']) / 2)}"


def sweep_sections(sweep_dir: Path) -> list[Section]:
    agg = read_json(Path(sweep_dir) / "aggregate.json")
    seeds = [str(s) for s in agg["seeds"]]
    sections = []
    claims = claims_section(sweep_dir)
    if claims is not None:
        sections.append(claims)
    rows = []
    for key, info in agg["keys"].items():
        if key.startswith("claims.") or key == "wall_time_s":
            continue
        row = {"metric": key, "mean ± CI half-width": _cell(info),
               "95% CI": "" if info["ci_lo"] is None else f"[{fmt(info['ci_lo'])}, {fmt(info['ci_hi'])}]"}  # fmt: skip
        row.update(
            {f"seed {s}": fmt(info["per_seed"].get(s)) if s in info["per_seed"] else "–" for s in seeds}
        )
        rows.append(row)
    text = (f"{len(seeds)} seeds ({', '.join(seeds)}) of recipe `{agg['recipe']}`. Interval: {agg['interval']}. "
            "Run folders: " + ", ".join(f"`{p}`" for p in agg["runs"]) + ".")  # fmt: skip
    if agg.get("failed"):
        text += " **Failed seeds (not aggregated):** " + "; ".join(
            f"{s}: {e}" for s, e in agg["failed"].items()
        )
    sections.append(Section("Metrics over seeds", text=text, table=rows))
    sections += _recipe_sweep_sections(agg)
    if "wall_time_s" in agg["keys"]:
        info = agg["keys"]["wall_time_s"]
        sections.append(Section("Wall time", text=f"{_cell(info)} s per seed."))
    return sections


def _recipe_sweep_sections(agg: dict) -> list[Section]:
    """Sections the recipe draws over all seeds (its entry module's ``sweep_sections(run_dirs)``), if any."""
    from reprlab.errors import ReprlabError
    from reprlab.recipes import get_recipe

    try:
        fn = getattr(get_recipe(agg["recipe"]).module(), "sweep_sections", None)
    except ReprlabError:
        return []
    runs = [Path(p) for p in agg["runs"] if Path(p).is_dir()]
    return list(fn(runs)) if fn is not None and runs else []


def build_sweep_report(sweep_dir: Path | str) -> tuple[Path, Path]:
    sweep_dir = Path(sweep_dir)
    recipe = read_json(sweep_dir / "aggregate.json")["recipe"]
    return render(sweep_sections(sweep_dir), f"reprlab sweep: {recipe}", sweep_dir)
