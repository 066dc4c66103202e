"""Build a run's report from its saved files alone (config.yaml, summary.json, metrics.jsonl, artefacts)."""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from pathlib import Path
from typing import Any

import yaml

from reprlab.errors import RunFolderError
from reprlab.report.render import render
from reprlab.report.section import Section
from reprlab.runs.atomic import read_json

log = logging.getLogger(__name__)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """All lines of ``metrics.jsonl``; a corrupt line raises naming the file and line number."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{i} is not valid JSON: {err}") from err
    return rows


def metric_curves_section(rows: list[dict[str, Any]], max_panels: int = 12) -> Section | None:
    """One small panel per numeric metric over steps, split by any string-valued key (e.g. a defense)."""
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, dict[str, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        group = "/".join(str(v) for k, v in sorted(row.items()) if isinstance(v, str))
        for key, value in row.items():
            if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                series[key][group].append((row["step"], float(value)))
    keys = [k for k in series if sum(len(v) for v in series[k].values()) > 1][:max_panels]
    if not keys:
        return None
    cols = min(3, len(keys))
    nrows = (len(keys) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 2.8 * nrows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        for group, points in series[key].items():
            xs, ys = zip(*points)
            ax.plot(xs, ys, label=group or None, lw=1.2)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        if len(series[key]) > 1:
            ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    fig.tight_layout()
    return Section("Training curves", text="Every numeric metric in metrics.jsonl over steps.", figure=fig)


def headline_section(run_dir: Path, max_rows: int = 60) -> Section:
    """The first ``max_rows`` keys of summary.json; recipes with big grids show them in their own tables."""
    path = Path(run_dir) / "summary.json"
    if not path.exists():
        return Section("Headline metrics", text="summary.json is missing: the run did not finish.")
    summary = read_json(path)
    rows = [{"metric": k, "value": v} for k, v in summary.items()]
    text = ""
    if len(rows) > max_rows:
        text = f"First {max_rows} of {len(rows)} keys; all of them are in summary.json."
    return Section("Headline metrics", text=text, table=rows[:max_rows])


def claims_section(run_dir: Path) -> Section | None:
    """The recipe's declared claims with their verdicts (``claims.json``, written when the run finished)."""
    path = Path(run_dir) / "claims.json"
    if not path.exists():
        return None
    rows = read_json(path).get("claims", [])
    if not rows:
        return None
    held = sum(r["verdict"] == "holds" for r in rows)
    na = sum(r["verdict"] == "n/a" for r in rows)
    text = (f"{held} of {len(rows)} declared claims hold" + (f" ({na} not measured)" if na else "") + ". "
            "A claim is a check over summary.json keys declared by the recipe; one run is one seed, an anecdote: "
            "`reprlab run RECIPE --seeds 0,1,2` gives the share of seeds on which each holds.")  # fmt: skip
    if "holds on seeds" in rows[0]:
        text = (f"{held} of {len(rows)} declared claims hold on the mean over seeds"
                + (f" ({na} not measured)" if na else "") + "; 'holds on seeds' is the share of seeds on which "
                "each holds.")  # fmt: skip
    return Section("Claims", text=text, table=rows)


def recipe_sections(run_dir: Path) -> list[Section]:
    """Sections the recipe's entry module builds from saved artefacts (empty when it defines none)."""
    from reprlab.recipes import get_recipe, recipe_name_of_run

    name = recipe_name_of_run(run_dir)
    if name is None:
        return []
    try:
        module = get_recipe(name).module()
    except KeyError:
        log.warning("recipe %s is not installed; report has only generic sections", name)
        return []
    fn = getattr(module, "report_sections", None)
    return list(fn(Path(run_dir))) if fn else []


def run_sections(run_dir: Path) -> list[Section]:
    run_dir = Path(run_dir)
    sections = [headline_section(run_dir)]
    claims = claims_section(run_dir)
    if claims is not None:
        sections.insert(0, claims)
    sections += recipe_sections(run_dir)
    has_curves = any(sec.title == "Training curves" for sec in sections)  # the recipe drew its own
    curves = None if has_curves else metric_curves_section(read_metrics(run_dir))
    if curves is not None:
        sections.append(curves)
    cfg_path = run_dir / "config.yaml"
    if cfg_path.exists():
        sections.append(Section("Config", text="```\n" + cfg_path.read_text() + "\n```"))
    env_path = run_dir / "env.json"
    if env_path.exists():
        env = read_json(env_path)
        sections.append(Section("Environment", text=yaml.safe_dump(env, sort_keys=False, width=200)))
    return sections


def build_report(run_dir: Path | str, title: str | None = None) -> tuple[Path, Path]:
    """Write ``report.html`` and ``report.md`` into ``run_dir``; returns their paths."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunFolderError(f"run folder {run_dir} does not exist")
    if not (run_dir / "config.yaml").exists():
        raise RunFolderError(f"{run_dir} is not a reprlab run folder (no config.yaml)")
    from reprlab.recipes import recipe_name_of_run

    title = title or f"reprlab run: {recipe_name_of_run(run_dir) or run_dir.name}"
    return render(run_sections(run_dir), title, run_dir)
