"""The one command-line interface: ``reprlab run | recipes | config | report | demo``.

Examples::

    reprlab recipes
    reprlab run rote-fda-tiny --out runs/fda train.steps=500
    reprlab run rote-fda-tiny --out runs/fda --resume        # continue an interrupted run
    reprlab report runs/fda                                   # rebuild report.html/.md from saved files
    reprlab demo                                              # every method's short recipe, one report
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import typer

from reprlab.recipes import all_recipes, get_recipe
from reprlab.runner import execute

__all__ = ["app", "execute", "main"]

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="reprlab: representation-level robustness research (OTCCLIP, Reason to Rote, CRL safety, Norm-IC).",
    pretty_exceptions_enable=False,
)


def _setup_logging(quiet: bool) -> None:
    level = logging.WARNING if quiet else logging.INFO
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if quiet:
        os.environ["REPRLAB_QUIET"] = "1"
    for noisy in ("httpx", "urllib3", "matplotlib", "PIL"):
        logging.getLogger(noisy).setLevel(logging.WARNING)




@app.command("recipes")
def recipes_cmd() -> None:
    """List every recipe with a one-line description."""
    from rich.console import Console
    from rich.table import Table

    table = Table("recipe", "method", "description", show_lines=False)
    for name, recipe in sorted(all_recipes().items(), key=lambda kv: (kv[1].method, kv[0])):
        table.add_row(name, recipe.method, recipe.description.splitlines()[0])
    Console().print(table)


@app.command("run")
def run_cmd(
    recipe: str = typer.Argument(..., help="Recipe name (see `reprlab recipes`) or path to a recipe YAML."),
    overrides: list[str] = typer.Argument(None, help="Config overrides as dotted key=value, e.g. train.lr=3e-4."),
    out: Path = typer.Option(None, "--out", "-o", help="Run folder (default: runs/<recipe>-<time>)."),
    resume: bool = typer.Option(False, "--resume", help="Continue an interrupted run in --out from its checkpoints."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the results of an existing run in --out."),
    demo: bool = typer.Option(False, "--demo", help="Apply the recipe's short demo overrides first."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bars, warnings only (CI)."),
) -> None:
    """Run a recipe and write its run folder (config, metrics, checkpoints, summary, report)."""
    _setup_logging(quiet)
    run_dir = execute(recipe, overrides or [], out, resume=resume, overwrite=overwrite, quiet=quiet, demo=demo)
    if int(os.environ.get("RANK", "0")) == 0:
        typer.echo(f"done: {run_dir}/summary.json, report: {run_dir}/report.html")


@app.command("config")
def config_cmd(
    recipe: str = typer.Argument(..., help="Recipe name."),
    overrides: list[str] = typer.Argument(None, help="Overrides to apply before printing."),
) -> None:
    """Print a recipe's resolved config and every key you can override, with help texts."""
    import yaml

    from reprlab.config import config_to_dict
    from reprlab.config.load import field_help

    r = get_recipe(recipe)
    cfg = r.build_config(overrides or [])
    typer.echo(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    typer.echo("# keys (type, default): help")
    for key, tp, default, help_text in field_help(type(cfg)):
        typer.echo(f"#   {key} ({tp}, {default!r}): {help_text}")


@app.command("report")
def report_cmd(run_dir: Path = typer.Argument(..., help="A run folder written by `reprlab run`.")) -> None:
    """Rebuild report.html and report.md from a run folder's saved files alone."""
    from reprlab.report.build import build_report

    if (run_dir / "demo.json").exists():
        from reprlab.demo import build_demo_report

        html_path, md_path = build_demo_report(run_dir)
    else:
        html_path, md_path = build_report(run_dir)
    typer.echo(f"wrote {html_path} and {md_path}")


@app.command("demo")
def demo_cmd(
    out: Path = typer.Option(Path("runs/demo"), "--out", "-o", help="Folder for the demo runs and combined report."),
    only: str = typer.Option("", help="Comma-separated recipe names to run (default: every demo recipe)."),
    resume: bool = typer.Option(False, "--resume", help="Skip finished recipes and resume an interrupted one."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bars."),
) -> None:
    """Run every method's short demo recipe and write one combined report (about 15 minutes on 2 CPU cores)."""
    from reprlab.demo import run_demo

    _setup_logging(quiet)
    names = [n for n in only.split(",") if n] or None
    report = run_demo(out, names=names, resume=resume, quiet=quiet)
    typer.echo(f"demo report: {report}")


def _mount_method_apps() -> None:
    """Mount method sub-commands (``reprlab otcclip audit ...``) when their modules import."""
    import importlib

    for method, module in (("otcclip", "reprlab.methods.otcclip.cli"),):
        try:
            sub = importlib.import_module(module).app
        except (ImportError, AttributeError):
            continue
        app.add_typer(sub, name=method, help=f"{method} tools.")


_mount_method_apps()


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
