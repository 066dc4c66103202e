"""``reprlab export`` for OTCCLIP runs: a trained defense's model as an open_clip or a transformers CLIP folder.

``reprlab export RUN_DIR --stage <defense> --open-clip OUT`` (a run with ``model.arch=open_clip:<name>``) or
``--hf OUT`` (``model.arch=hf_clip``); ``--stage`` is a defense the run trained (``none``, ``roclip``,
``safeclip``, ``cleanclip``, ``otcclip``), its last epoch checkpoint. The folder layouts and what carries over
are in :mod:`.models.export`; ``model.arch=tiny`` (our own ViT) has no third-party format and says so.
"""

from __future__ import annotations

from pathlib import Path

from reprlab.errors import ConfigError, RunFolderError
from reprlab.methods.otcclip.defenses import REGISTRY
from reprlab.methods.otcclip.models import export as fmt
from reprlab.methods.otcclip.models.run_model import load_run_model, run_config

STAGES = tuple(REGISTRY)
FORMATS = ("open_clip", "hf")  # reprlab.export: each a CLI option (--open-clip, --hf)


def _format_of(arch: str) -> str:
    """The one format ``arch`` exports to.

    Raises:
        NoThirdPartyFormat: the tiny arch.
    """
    if arch.startswith("open_clip:"):
        return "open_clip"
    if arch == "hf_clip":
        return "hf"
    raise fmt.no_third_party_format(arch)


def check_stage(run_dir: Path, stage: str) -> None:
    """Raise unless ``run_dir`` is an OTCCLIP run whose defense ``stage`` finished training."""
    run_dir = Path(run_dir)
    if stage not in STAGES:
        raise ConfigError(f"unknown OTCCLIP defense {stage!r}; valid stages: {', '.join(STAGES)}")
    done = run_dir / "stages" / f"{stage}.json"
    if not done.exists():
        cfg = run_config(run_dir)
        trained = [d for d in cfg.defenses if (run_dir / "stages" / f"{d}.json").exists()]
        raise RunFolderError(
            f"run folder {run_dir} has no finished {stage!r} defense ({done.relative_to(run_dir)} is missing; the "
            f"run's defenses: {', '.join(cfg.defenses)}; trained: {', '.join(trained) or 'none'})",
            "export a trained defense, or finish the run with `reprlab run ... --resume`",
        )


def export(run_dir: Path, stage: str, outputs: dict[str, Path]) -> dict[str, Path]:
    """Write the requested ``{format: folder}`` of defense ``stage``; returns them.

    Raises:
        NoThirdPartyFormat: a ``tiny`` run. ConfigError: a format that is not the run's arch's (the message
            names the one it has).
    """
    run_dir = Path(run_dir)
    arch = run_config(run_dir).model.arch
    own = _format_of(arch)
    other = [f for f in outputs if f != own]
    if other:
        opt = "--" + own.replace("_", "-")
        raise ConfigError(
            f"this run's model.arch is {arch!r}, which exports as {opt} only (asked for "
            f"{', '.join('--' + f.replace('_', '-') for f in other)})"
        )
    model, tok, cfg = load_run_model(run_dir, stage)
    model.eval()
    note = f"Defense `{stage}` of the OTCCLIP run in `{run_dir}` (model.arch `{arch}`)."
    out = outputs[own]
    if own == "open_clip":
        from reprlab.methods.otcclip.models.openclip import model_config

        return {own: fmt.write_open_clip(model, model_config(arch.partition(":")[2]), out, note)}
    return {own: fmt.write_hf(model, tok, out, note)}
