"""``reprlab demo``: run every method's short demo variant and stitch their reports into one page."""

from __future__ import annotations

import logging
import time
import traceback
from pathlib import Path

from reprlab.errors import RecipeError
from reprlab.recipes import all_recipes
from reprlab.report.build import run_sections
from reprlab.report.render import render, slug
from reprlab.report.section import Section
from reprlab.runs.atomic import atomic_write_json, read_json

log = logging.getLogger(__name__)


def demo_recipes(names: list[str] | None = None) -> list[str]:
    """The recipes ``reprlab demo`` runs: one per method, those whose YAML sets ``demo_order``, in that order.

    Other recipes may still define ``demo`` overrides for ``reprlab run <recipe> --demo``.
    """
    recipes = all_recipes()
    if names:
        unknown = [n for n in names if n not in recipes]
        if unknown:
            raise RecipeError(f"unknown recipes {unknown}; available: {', '.join(sorted(recipes))}")
        return names
    chosen = [r for r in recipes.values() if r.demo_order is not None]
    chosen.sort(key=lambda r: (r.demo_order, r.name))
    return [r.name for r in chosen]


def run_demo(out: Path, names: list[str] | None = None, resume: bool = False, quiet: bool = False) -> Path:
    """Run the demo recipes one after another into ``out/<recipe>`` and write ``out/report.html``.

    A recipe that fails is recorded with its error and the demo goes on, so one broken method does not hide
    the others; the function raises at the end if any failed.
    """
    from reprlab.runner import execute

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    status_path = out / "demo.json"
    previous = (
        {e["recipe"]: e for e in read_json(status_path)["runs"]} if resume and status_path.exists() else {}
    )
    entries = []
    for name in demo_recipes(names):
        if previous.get(name, {}).get("status") == "ok":
            entries.append(previous[name])
            continue
        run_dir = out / name
        t0 = time.time()
        entry = {"recipe": name, "run_dir": name, "overrides": list(all_recipes()[name].demo)}
        try:
            execute(name, (), run_dir, resume=resume and (run_dir / "config.yaml").exists(),
                    overwrite=not resume, quiet=quiet, demo=True)  # fmt: skip
            entry["status"] = "ok"
        except Exception as err:  # keep going: the report shows which method failed and why
            log.error("demo recipe %s failed: %s", name, err)
            entry["status"] = "failed"
            entry["error"] = "".join(traceback.format_exception_only(type(err), err)).strip()
        entry["wall_time_s"] = round(time.time() - t0, 1)
        entries.append(entry)
        atomic_write_json(status_path, {"runs": entries + [previous[n] for n in previous if n not in
                                                          {e["recipe"] for e in entries}]})  # fmt: skip
    atomic_write_json(status_path, {"runs": entries})
    html_path, _ = build_demo_report(out)
    failed = [e["recipe"] for e in entries if e["status"] != "ok"]
    if failed:
        raise RuntimeError(f"demo recipes failed: {failed}; see {html_path}")
    return html_path


def build_demo_report(out: Path) -> tuple[Path, Path]:
    """Combined report from ``demo.json`` and each run folder's saved files.

    It opens with every method's claim verdicts on one table, then one section per method whose first part
    is that method's claims and curated headline table, as in its own report.
    """
    out = Path(out)
    entries = read_json(out / "demo.json")["runs"]
    rows = []
    for e in entries:
        row = f"| [{e['recipe']}](#{e['recipe']}) | {e['status']} |"
        claims_path = out / e["run_dir"] / "claims.json"
        if e["status"] == "ok" and claims_path.exists():
            verdicts = [c["verdict"] for c in read_json(claims_path)["claims"]]
            row += " " + " | ".join(str(verdicts.count(v)) for v in ("holds", "does not hold", "n/a")) + " |"
        else:
            row += " – | – | – |"
        rows.append(row)
    overview = Section(
        "Claims across methods",
        text=("Each method's declared claims on its demo run, counted by verdict; each method's own section "
              "below opens with its claims (with their evidence, and the reason for every n/a) and its headline "
              "table.\n\n| recipe | status | hold | do not hold | n/a |\n|---|---|---:|---:|---:|\n"
              + "\n".join(rows)),
        anchor="claims",
    )  # fmt: skip
    what_ran = Section(
        "What ran",
        text=("Each method's **demo variant**: the recipe's tiny CPU config with its `demo` overrides applied "
              "(shorter than the full tiny recipe, so numbers are weaker). Rerun one in full with "
              "`reprlab run <recipe>`. Wall seconds are the whole call, model loading and the report included; "
              "a run's own `wall_time_s` in its summary.json counts from its start to its summary."),
        table=[{"recipe": e["recipe"], "status": e["status"], "wall seconds": e.get("wall_time_s"),
                "demo overrides": " ".join(e.get("overrides", [])) or "(none)"} for e in entries],
        level=2, collapsed=True,
    )  # fmt: skip
    sections = [overview, what_ran]
    for e in entries:
        run_dir = out / e["run_dir"]
        if e["status"] != "ok" or not run_dir.exists():
            sections.append(Section(e["recipe"], text=f"FAILED: {e.get('error', 'no run folder')}", level=2,
                                    anchor=e["recipe"]))  # fmt: skip
            continue
        sec = Section(e["recipe"], text=f"Run folder: `{run_dir}` (its own report: `{run_dir}/report.html`).",
                      level=2, anchor=e["recipe"])  # fmt: skip
        for child in run_sections(run_dir, reference=False):
            child.anchor = f"{e['recipe']}-{child.anchor or slug(child.title)}"
            sec.children.append(child)
        sections.append(sec)
    return render(sections, "reprlab demo: every method's short recipe", out)
