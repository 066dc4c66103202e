"""Build a run's report from its saved files alone (config.yaml, summary.json, metrics.jsonl, artefacts)."""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from pathlib import Path
from typing import Any

import yaml

from reprlab.errors import ReprlabError, RunFolderError
from reprlab.jsonfile import NULL_REASON
from reprlab.report.figures import pyplot
from reprlab.report.headline import headlines_of, run_headline
from reprlab.report.render import plural, render
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
    """One panel per numeric metric over steps, split by any string-valued key (e.g. a defense)."""
    if not rows:
        return None
    series: dict[str, dict[str, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        group = "/".join(str(v) for k, v in sorted(row.items()) if isinstance(v, str))
        for key, value in row.items():
            if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                series[key][group].append((row["step"], float(value)))
    keys = [k for k in series if sum(len(v) for v in series[k].values()) > 1][:max_panels]
    if not keys:
        return None
    plt = pyplot()
    cols = min(3, len(keys))
    nrows = (len(keys) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(5.0 * cols, 3.6 * nrows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        for group, points in series[key].items():
            xs, ys = zip(*points)
            ax.plot(xs, ys, label=group or None, lw=1.5)
        ax.set_title(key)
        ax.set_xlabel("step")
        if len(series[key]) > 1:
            ax.legend()
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    fig.tight_layout()
    return Section("Training curves", text="Every numeric metric in metrics.jsonl over steps.", figure=fig,
                   collapsed=True)  # fmt: skip


def summary_section(run_dir: Path) -> Section:
    """Every key of summary.json, folded: the full record behind the curated headline table."""
    path = Path(run_dir) / "summary.json"
    if not path.exists():
        return Section("Every summary value", text="summary.json is missing: the run did not finish.")
    summary = read_json(path)
    rows = [{"key": k, "value": v} for k, v in summary.items() if not k.endswith(NULL_REASON)]
    reasons = {k[: -len(NULL_REASON)]: v for k, v in summary.items() if k.endswith(NULL_REASON)}
    for row in rows:
        if row["key"] in reasons:
            row["value"] = f"n/a ({reasons[row['key']]})"
    return Section("Every summary value", text=f"All {len(rows)} keys of summary.json.", table=rows,
                   collapsed=True)  # fmt: skip


def claims_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Report rows of ``claims.json`` entries: verdict, claim, statement, and the evidence or the reason."""
    out = []
    for r in rows:
        why = r.get("lines") or [r.get("evidence", "")]
        if r["verdict"] == "n/a":
            why = (
                [r.get("reason") or r.get("evidence", "")]
                if not r.get("lines")
                else ["precondition not met:", *r["lines"]]
            )
        row = {"verdict": r["verdict"], "claim": [r["claim"], r.get("statement", "")],
               "evidence (✓ met, ✗ not met)": why}  # fmt: skip
        share = r.get("holds on seeds")
        if isinstance(share, dict) and share.get("n"):
            k = round(share["mean"] * share["n"])
            ci = "" if share.get("ci_lo") is None else f" [{share['ci_lo']:.2f}, {share['ci_hi']:.2f}]"
            row["holds on seeds"] = f"{k}/{share['n']}{ci}"
        elif "holds on seeds" in r:
            row["holds on seeds"] = "n/a"
        out.append(row)
    return out


def claims_text(rows: list[dict[str, Any]], sweep: bool = False) -> str:
    """One sentence counting the verdicts, and what an n/a means."""
    n = len(rows)
    held = sum(r["verdict"] == "holds" for r in rows)
    failed = sum(r["verdict"] == "does not hold" for r in rows)
    na = n - held - failed
    pre = sum(r["verdict"] == "n/a" and (r.get("reason") or "").startswith("precondition") for r in rows)
    sweep_only = sum(r["verdict"] == "n/a" and (r.get("reason") or "").startswith("sweep only") for r in rows)
    parts = []
    if pre:
        parts.append(f"{pre} because a precondition was not met")
    if sweep_only:
        parts.append(f"{plural(sweep_only, 'needs', 'need')} a seed sweep")
    rest = na - pre - sweep_only
    if rest:
        parts.append(f"{rest} not measured on this run")

    text = (f"Of {plural(n, 'declared claim')}, **{plural(held, 'holds', 'hold')}**, "
            f"**{plural(failed, 'does', 'do')} not hold** and **{plural(na, 'is', 'are')} not applicable**"
            + (f" ({'; '.join(parts)})" if parts else "") + ". ")  # fmt: skip
    if sweep:
        return text + ("Verdicts are checked on the mean over seeds; 'holds on seeds' counts the seeds on which "
                       "each claim holds, with its Wilson 95% interval.")  # fmt: skip
    return text + ("Each claim is a check over summary.json declared by the recipe (docs/reports.md). "
                   "One run is one seed, an anecdote: `reprlab run RECIPE --seeds 0,1,2` gives the share of seeds "
                   "on which each holds.")  # fmt: skip


def claims_section(run_dir: Path, headline: list[tuple[str, list[dict[str, Any]]]] | None = None,
                   sweep: bool = False) -> Section | None:  # fmt: skip
    """The first section of a report: the recipe's declared claims with their verdicts (``claims.json``) and
    the method's curated headline table(s)."""
    path = Path(run_dir) / "claims.json"
    rows = read_json(path).get("claims", []) if path.exists() else []
    if not rows and not headline:
        return None
    text = claims_text(rows, sweep) if rows else "This recipe declares no claims."
    return Section("Claims and headline results", text=text, table=claims_rows(rows) if rows else None,
                   tables=list(headline or []), anchor="claims")  # fmt: skip


def run_headline_tables(run_dir: Path) -> list[tuple[str, list[dict[str, Any]]]]:
    """The recipe's curated headline tables (its entry module's ``HEADLINE``) for one run."""
    path = Path(run_dir) / "summary.json"
    module = _recipe_module(run_dir)
    if module is None or not path.exists():
        return []
    summary = read_json(path)
    out = []
    for h in headlines_of(module, summary):
        rows = run_headline(h, summary)
        if rows:
            out.append((h.caption or "Headline results", rows))
    return out


def _recipe_module(run_dir: Path):
    from reprlab.recipes import get_recipe, recipe_name_of_run

    name = recipe_name_of_run(run_dir)
    if name is None:
        return None
    try:
        return get_recipe(name).module()
    except (ReprlabError, ImportError):
        log.warning("recipe %s is not installed; report has only generic sections", name)
        return None


def recipe_sections(run_dir: Path) -> list[Section]:
    """Sections the recipe's entry module builds from saved artefacts (empty when it defines none)."""
    module = _recipe_module(run_dir)
    fn = getattr(module, "report_sections", None) if module is not None else None
    return list(fn(Path(run_dir))) if fn else []


def run_sections(run_dir: Path, reference: bool = True) -> list[Section]:
    """Every section of a run's report: claims and headline first, the method's sections and training
    curves, then (with ``reference``) every summary value, config and environment, folded."""
    run_dir = Path(run_dir)
    sections = []
    if not (run_dir / "summary.json").exists():  # said first, not only in the folded summary section
        sections.append(Section("This run did not finish", text=(
            "summary.json is missing: the run stopped before its end, so what follows is partial (the training "
            "curves and stages written so far). `reprlab run RECIPE --out RUN --resume` finishes it.")))  # fmt: skip
    claims = claims_section(run_dir, run_headline_tables(run_dir))
    if claims is not None:
        sections.append(claims)
    sections += recipe_sections(run_dir)
    has_curves = any(sec.title == "Training curves" for sec in sections)  # the recipe drew its own
    curves = None if has_curves else metric_curves_section(read_metrics(run_dir))
    if curves is not None:
        sections.append(curves)
    if not reference:
        return sections
    sections.append(summary_section(run_dir))
    cfg_path = run_dir / "config.yaml"
    if cfg_path.exists():
        sections.append(Section("Config", text="```yaml\n" + cfg_path.read_text() + "\n```", collapsed=True))
    env_path = run_dir / "env.json"
    if env_path.exists():
        env = read_json(env_path)
        sections.append(Section("Environment", text="```yaml\n" + yaml.safe_dump(env, sort_keys=False, width=200)
                                + "```", collapsed=True))  # fmt: skip
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
