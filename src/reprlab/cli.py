"""The one command-line interface: ``reprlab run | recipes | config | report | aggregate | demo | export |
convert-checkpoint``.

Examples::

    reprlab recipes
    reprlab run rote-fda-tiny --out runs/fda train.steps=500
    reprlab run rote-fda-tiny --out runs/fda --resume        # continue an interrupted run
    reprlab run rote-fda-tiny --out runs/fda --resume-from train/step_00000200  # from an older checkpoint
    reprlab run rote-fda-tiny --seeds 0,1,2 --out runs/fda3  # one run per seed + mean/CI aggregate
    reprlab aggregate runs/fda3                               # rebuild the aggregate from run folders
    reprlab report runs/fda                                   # rebuild report.html/.md from saved files
    reprlab demo                                              # every method's short recipe, one report
    reprlab export runs/crl --stage crl --adapter out/crl-lora   # a peft adapter folder (PeftModel)
    reprlab export runs/crl --stage crl --merged out/crl-model   # a merged model folder (AutoModelForCausalLM)
    reprlab convert-checkpoint runs/old                       # older pickled checkpoints -> safetensors + JSON

Input errors (:class:`reprlab.errors.ReprlabError`) print one message and its fix, and exit with status 2;
``--debug`` or ``REPRLAB_DEBUG=1`` shows the traceback.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from reprlab.errors import ReprlabError
from reprlab.recipes import all_recipes, get_recipe
from reprlab.runner import execute

__all__ = ["app", "execute", "main"]

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="reprlab: representation-level robustness research (OTCCLIP, Reason to Rote, CRL safety, Norm-IC).",
    pretty_exceptions_enable=False,
)


def _debug() -> bool:
    return os.environ.get("REPRLAB_DEBUG", "0") not in ("", "0")


class Terminated(KeyboardInterrupt):
    """SIGTERM (Slurm's and submitit's stop, a job preempted, `kill`) raised where the program is, as Ctrl-C is:
    the same clean-up runs (an ``--overwrite`` puts the old results back, the run folder's lock is let go)."""


def _term_as_interrupt() -> None:
    """Make SIGTERM raise :class:`Terminated` in the main thread (the console entry points only, never on
    import: a library caller keeps its own handler)."""
    import signal
    import threading

    owner = os.getpid()

    def _raise(signum: int, frame: Any) -> None:
        if os.getpid() != owner:
            # a forked worker (a multiprocessing pool stops its workers with SIGTERM) inherits the handler:
            # it dies as it would have, quietly, instead of printing a Terminated traceback
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        raise Terminated()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise)


def _undone(err: BaseException) -> str | None:
    """What to say when the failed command was an ``--overwrite`` whose old results were put back."""
    restored = getattr(err, "reprlab_restored", None)
    return (
        None
        if restored is None
        else f"the --overwrite was undone: {restored} holds its earlier results again"
    )


def user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Print a :class:`ReprlabError` as one message (and its hint) and exit 2; a bug keeps its traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ReprlabError as err:
            if _debug():
                raise
            typer.echo(f"error: {err}", err=True)
            undone = _undone(err)
            if undone:
                typer.echo(undone, err=True)
            if err.hint and not (undone and "--resume" in err.hint):  # a resume would continue the old run
                typer.echo(f"hint: {err.hint}", err=True)
            raise typer.Exit(2) from None
        except KeyboardInterrupt as err:
            if _debug():
                raise
            what = "terminated (SIGTERM)" if isinstance(err, Terminated) else "interrupted"
            then = _undone(err) or "`reprlab run ... --resume` continues from the last checkpoint"
            typer.echo(f"{what}; {then}", err=True)
            raise typer.Exit(143 if isinstance(err, Terminated) else 130) from None

    return wrapper


@app.callback()
def _global(
    debug: bool = typer.Option(
        False, "--debug", help="Show full tracebacks for input errors (or REPRLAB_DEBUG=1)."
    ),
    verbose: bool = typer.Option(
        False,
        "--verbose",
        "-v",
        help="Also show third-party INFO logs and FutureWarnings (or REPRLAB_VERBOSE=1).",
    ),
) -> None:
    if debug:
        os.environ["REPRLAB_DEBUG"] = "1"
    if verbose:
        os.environ["REPRLAB_VERBOSE"] = "1"


def _setup_logging(quiet: bool) -> None:
    # the root logger passes INFO (run.log keeps it); the console handler shows WARNING and up with --quiet
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            handler.setLevel(logging.WARNING if quiet else logging.NOTSET)
    if quiet:
        os.environ["REPRLAB_QUIET"] = "1"
    from reprlab.quiet import QUIET_LOGGERS, verbose

    if (
        not verbose()
    ):  # third-party INFO chatter (gensim's per-epoch lines, ...); `reprlab -v run ...` shows it
        for noisy in QUIET_LOGGERS:
            logging.getLogger(noisy).setLevel(logging.WARNING)


@app.command("recipes")
@user_errors
def recipes_cmd() -> None:
    """List every recipe with a one-line description."""
    from rich.console import Console
    from rich.table import Table

    table = Table("recipe", "method", "description", show_lines=False)
    for name, recipe in sorted(all_recipes().items(), key=lambda kv: (kv[1].method, kv[0])):
        table.add_row(name, recipe.method, recipe.description.splitlines()[0])
    Console().print(table)


@app.command("run")
@user_errors
def run_cmd(
    recipe: str = typer.Argument(..., help="Recipe name (see `reprlab recipes`) or path to a recipe YAML."),
    overrides: list[str] = typer.Argument(None, help="Config overrides as dotted key=value, e.g. train.lr=3e-4."),
    out: Path = typer.Option(None, "--out", "-o", help="Run folder (default: runs/<recipe>-<time>); a sweep's folder with --seeds."),
    resume: bool = typer.Option(False, "--resume", help="Continue an interrupted run (or sweep) in --out from its checkpoints."),
    resume_from: str = typer.Option(None, "--resume-from", help="Resume from this checkpoint (STAGE/step_N, as a failed --resume names it) instead of the newest; what came after it runs again."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the run in --out; the old results are deleted only when the new run finishes."),
    demo: bool = typer.Option(False, "--demo", help="Apply the recipe's short demo overrides first."),
    seeds: str = typer.Option("", "--seeds", help="Run once per seed (0,1,2 or 0-4) into --out/seed-<s>/ and aggregate mean ± 95% CI."),
    launcher: str = typer.Option("inline", "--launcher", help="With --seeds: inline (one after another), submitit-local or submitit-slurm (one job per seed)."),
    launcher_opt: list[str] = typer.Option(None, "--launcher-opt", help="submitit parameter key=value, e.g. slurm_partition=gpu, timeout_min=120, gpus_per_node=1."),
    track: str = typer.Option(None, "--track", help="Also log metrics to tensorboard and/or wandb (comma-separated; default $REPRLAB_TRACK)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bars, warnings only (CI)."),
) -> None:  # fmt: skip
    """Run a recipe and write its run folder (config, metrics, checkpoints, summary, claims, report)."""
    _setup_logging(quiet)
    if resume_from and seeds:
        from reprlab.errors import ConfigError

        raise ConfigError("--resume-from names one run's checkpoint; resume that seed's folder on its own")
    resume = resume or bool(resume_from)
    if seeds:
        from reprlab.sweep import parse_seeds, run_sweep

        opts = dict(_parse_opt(o) for o in launcher_opt or [])
        sweep_dir = run_sweep(recipe, parse_seeds(seeds), overrides or [], out, resume=resume, overwrite=overwrite,
                              quiet=quiet, demo=demo, track=track, launcher=launcher, launcher_opts=opts)  # fmt: skip
        typer.echo(f"done: {sweep_dir}/summary.json (mean ± CI over seeds), report: {sweep_dir}/report.html")
        return
    if launcher != "inline" or launcher_opt:
        from reprlab.errors import ConfigError

        raise ConfigError("--launcher and --launcher-opt only apply to a seed sweep (--seeds)")
    run_dir = execute(recipe, overrides or [], out, resume=resume, overwrite=overwrite, quiet=quiet, demo=demo,
                      track=track, resume_from=resume_from)  # fmt: skip
    if int(os.environ.get("RANK", "0")) == 0:
        typer.echo(f"done: {run_dir}/summary.json, report: {run_dir}/report.html")


def _parse_opt(item: str) -> tuple[str, Any]:
    import yaml

    from reprlab.errors import ConfigError

    if "=" not in item:
        raise ConfigError(f"--launcher-opt {item!r} is not key=value")
    key, raw = item.split("=", 1)
    return key.strip(), yaml.safe_load(raw)


@app.command("aggregate")
@user_errors
def aggregate_cmd(
    folders: list[Path] = typer.Argument(..., help="Run folders, or folders holding run folders (a sweep)."),
    out: Path = typer.Option(None, "--out", "-o", help="Where to write the aggregate (default: the one folder given)."),
) -> None:  # fmt: skip
    """Aggregate run folders of one setting made anywhere (other machines, cluster jobs): mean ± 95% CI."""
    from reprlab.sweep import aggregate_folders

    dest = aggregate_folders(folders, out)
    typer.echo(f"wrote {dest}/summary.json and {dest}/report.html")


@app.command("config")
@user_errors
def config_cmd(
    recipe: str = typer.Argument(..., help="Recipe name."),
    overrides: list[str] = typer.Argument(None, help="Overrides to apply before printing."),
    demo: bool = typer.Option(
        False, "--demo", help="Print the demo variant (the recipe's demo overrides applied)."
    ),
) -> None:
    """Print the values `reprlab run RECIPE` would use: each key=value with its source and help, and the claims.

    The source is where the value came from: the recipe's YAML, its demo overrides (--demo), an override on
    the command line, or the Config dataclass default. The default is shown where the value differs from it.
    """
    from reprlab.config.load import format_value, parse_overrides, resolved_rows

    r = get_recipe(recipe)
    user = list(overrides or [])
    cfg = r.build_config([*(r.demo if demo else ()), *user])
    layers = [("recipe", r.config), ("demo", parse_overrides(r.demo) if demo else None),
              ("override", parse_overrides(user))]  # fmt: skip
    rows = resolved_rows(type(cfg), cfg, layers)
    cmd = " ".join(["reprlab run", r.name, *(["--demo"] if demo else []), *user])
    typer.echo(f"# `{cmd}` uses these values. Change any with key=value on the command line.")
    typer.echo(f"# source: recipe = {_shown_path(r.path)}" + (f"; demo = its demo overrides ({' '.join(r.demo) or 'none'})"
               if demo else "") + "; override = the command line; default = the Config dataclass")  # fmt: skip
    width = min(44, max(len(f"{row['key']}={format_value(row['value'])}") for row in rows))
    src_width = max(len(_source_text(row)) for row in rows)
    for row in rows:
        kv = f"{row['key']}={format_value(row['value'])}"
        pad = " " * max(1, width - len(kv) + 2)
        typer.echo(f"{kv}{pad}{_source_text(row).ljust(src_width)}  {row['help']}")
    claims = r.claims()
    if claims:
        typer.echo("# claims (checked on summary.json after the run):")
        for c in claims:
            pre = f"  [if {c.requires}]" if c.requires else ""
            typer.echo(f"#   {c.name}: {c.check}{pre}    {c.text}")


def _source_text(row: dict) -> str:
    from reprlab.config.load import format_value

    if row["source"] == "default" or not row["differs"]:
        return row["source"]
    return f"{row['source']} (default {format_value(row['default'])})"


def _shown_path(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        parts = path.parts
        return "/".join(parts[parts.index("reprlab") :]) if "reprlab" in parts else str(path)


@app.command("report")
@user_errors
def report_cmd(
    run_dir: Path = typer.Argument(..., help="A run or sweep folder written by `reprlab run`."),
) -> None:
    """Rebuild report.html and report.md from a run (or sweep) folder's saved files alone."""
    from contextlib import nullcontext

    from reprlab.report.build import build_report
    from reprlab.runs.folder import refuse_if_being_written
    from reprlab.runs.lock import RunLock

    # a folder a live run or sweep writes is refused, and the report holds the lock while it writes, so that a
    # run cannot start under it (a missing folder falls through to the report's own error)
    refuse_if_being_written(run_dir)
    with RunLock.acquire(run_dir) if run_dir.is_dir() else nullcontext():
        if (run_dir / "aggregate.json").exists():
            from reprlab.report.sweep import build_sweep_report

            html_path, md_path = build_sweep_report(run_dir)
        elif (run_dir / "demo.json").exists():
            from reprlab.demo import build_demo_report

            html_path, md_path = build_demo_report(run_dir)
        else:
            html_path, md_path = build_report(run_dir)
    typer.echo(f"wrote {html_path} and {md_path}")


@app.command("export")
@user_errors
def export_cmd(
    run_dir: Path = typer.Argument(..., help="A run folder written by `reprlab run`."),
    stage: str = typer.Option(..., "--stage", help="Which trained model (CRL: refusal, rr, crl, crl_adv; OTCCLIP: a defense, e.g. otcclip)."),
    adapter: Path = typer.Option(None, "--adapter", help="CRL: write a peft adapter folder here (PeftModel.from_pretrained on the base)."),
    merged: Path = typer.Option(None, "--merged", help="CRL: write the merged model with tokenizer and chat template here (AutoModelForCausalLM)."),
    open_clip: Path = typer.Option(None, "--open-clip", help="OTCCLIP, model.arch=open_clip:<name>: write an open_clip model folder here (create_model_and_transforms('local-dir:OUT'))."),
    hf: Path = typer.Option(None, "--hf", help="OTCCLIP, model.arch=hf_clip: write a transformers CLIP folder here (CLIPModel.from_pretrained)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Warnings only."),
) -> None:  # fmt: skip
    """Export a trained model of a run in the formats other libraries load."""
    from reprlab.export import export_run

    _setup_logging(quiet)
    # option -> format name (reprlab.export.option); each method's FORMATS says which it writes
    given = {"adapter": adapter, "merged": merged, "open_clip": open_clip, "hf": hf}
    outputs = {fmt: path for fmt, path in given.items() if path is not None}
    for fmt, path in export_run(run_dir, stage, outputs).items():
        typer.echo(f"{fmt}: {path}")


@app.command("convert-checkpoint")
@user_errors
def convert_checkpoint_cmd(
    run_dir: Path = typer.Argument(..., help="A run folder (or a sweep folder) with old-format checkpoints."),
    trust: bool = typer.Option(False, "--trust", help="Unpickle in full what the restricted loader refuses. Can run code: only for run folders you made yourself."),
) -> None:  # fmt: skip
    """Rewrite checkpoints of older reprlab versions (pickled optim_*.pt, rng.pt) as safetensors + JSON."""
    from reprlab.runs.convert import convert_run

    _setup_logging(False)
    done = convert_run(run_dir, trust=trust)
    typer.echo(
        f"converted {len(done)} checkpoint(s) in {run_dir}" + ("" if done else " (none was old-format)")
    )


@app.command("demo")
@user_errors
def demo_cmd(
    out: Path = typer.Option(
        Path("runs/demo"), "--out", "-o", help="Folder for the demo runs and combined report."
    ),
    only: str = typer.Option("", help="Comma-separated recipe names to run (default: every demo recipe)."),
    resume: bool = typer.Option(
        False, "--resume", help="Skip finished recipes and resume an interrupted one."
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bars."),
) -> None:
    """Run every method's short demo recipe and write one combined report (minutes on 2 CPU cores; each run folder's run.log times its parts)."""
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
        for cmd in sub.registered_commands:  # the same readable errors for every sub-command
            if cmd.callback is not None:
                cmd.callback = user_errors(cmd.callback)
        app.add_typer(sub, name=method, help=f"{method} tools.")


_mount_method_apps()


def main() -> None:  # pragma: no cover - console entry
    _term_as_interrupt()
    app()


if __name__ == "__main__":  # pragma: no cover - `python -m reprlab.cli`, e.g. under torchrun
    _term_as_interrupt()
    sys.exit(app())
