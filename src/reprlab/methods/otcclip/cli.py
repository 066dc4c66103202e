"""Typer sub-app mounted by the main CLI as ``reprlab otcclip ...``."""

from __future__ import annotations

import json
from pathlib import Path

import typer

app = typer.Typer(help="OTCCLIP tools.", no_args_is_help=True)


@app.callback()
def _group() -> None:
    """OTCCLIP tools (a callback keeps ``audit`` a named sub-command even though it is the only one)."""


@app.command("audit")
def audit(
    data: Path = typer.Argument(..., help="CSV/TSV/JSONL of (image, caption) or webdataset .tar shard(s)"),
    out: Path = typer.Option(Path("audit"), help="output folder (flagged.csv, audit.html, audit.json)"),
    run_dir: Path = typer.Option(None, "--run", help="an otcclip run folder whose model to use"),
    defense: str = typer.Option("otcclip", help="which of the run's defenses' model to use"),
    hf_model: str = typer.Option(None, "--hf-model", help="a Hugging Face CLIP id or local folder instead"),
    top: int = typer.Option(50, help="pairs shown in the HTML report"),
    top_k: int = typer.Option(16, help="re-matching shortlist size"),
    alpha: float = typer.Option(0.5, help="S = alpha cos - (1 - alpha) OT distance"),
    max_items: int = typer.Option(None, help="audit only the first N valid pairs"),
) -> None:
    """Rank image-caption pairs by how suspicious they are and suggest better captions."""
    from reprlab.methods.otcclip.audit import main

    summary = main(
        data,
        out,
        run_dir=run_dir,
        defense=defense,
        hf_model=hf_model,
        top=top,
        top_k=top_k,
        alpha=alpha,
        max_items=max_items,
    )
    typer.echo(json.dumps(summary, indent=2))
    typer.echo(f"wrote {out / 'flagged.csv'} and {out / 'audit.html'}")
