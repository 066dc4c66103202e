"""``reprlab export``: a run's trained models in the formats other libraries load, one exporter per method.

A method plugs in by adding its module to :data:`EXPORTERS`. The module defines

* ``STAGES``: the names ``--stage`` accepts (e.g. CRL's ``refusal, rr, crl, crl_adv``);
* ``FORMATS``: the output formats (CRL: ``adapter``, ``merged``; OTCCLIP: ``open_clip``, ``hf``);
* ``export(run_dir, stage, outputs) -> {format: folder}``: writes each requested ``{format: folder}``,
  each folder atomically (one call, so the model loads once for several formats);
* ``check_stage(run_dir, stage)``: raises a :class:`reprlab.errors.ReprlabError` unless that stage finished
  (called before any weights load, for every requested format).

The CLI maps its options to format names (``--adapter`` -> ``adapter``, ``--open-clip`` -> ``open_clip``,
:func:`option`); a new format is one more option of ``reprlab export``.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

from reprlab.errors import ConfigError, RunFolderError

# the recipe entry module of a run -> the module that exports it
EXPORTERS: dict[str, str] = {
    "reprlab.methods.crl_safety.recipe": "reprlab.methods.crl_safety.export",
    "reprlab.methods.otcclip.recipe": "reprlab.methods.otcclip.export",
}


def option(fmt: str) -> str:
    """The CLI option of a format: ``open_clip`` -> ``--open-clip``."""
    return "--" + fmt.replace("_", "-")


def exporter_of(run_dir: Path) -> ModuleType:
    """The exporter module of the method that made ``run_dir``.

    Raises:
        RunFolderError: not a run folder, or its recipe cannot be found.
        ConfigError: the method has no exporter (the message names the methods that have one).
    """
    from reprlab.recipes import get_recipe, recipe_name_of_run

    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise RunFolderError(f"{run_dir} does not exist", "pass a folder written by `reprlab run`")
    if not (run_dir / "config.yaml").exists():
        raise RunFolderError(f"{run_dir} is not a run folder (no config.yaml)",
                             "pass a folder written by `reprlab run`")  # fmt: skip
    name = recipe_name_of_run(run_dir)
    if name is None:
        raise RunFolderError(f"{run_dir}/config.yaml does not say which recipe made the run (first line)")
    try:
        entry = get_recipe(name).entry
    except KeyError as err:
        raise RunFolderError(f"{run_dir}: recipe {name!r} is not installed ({err})") from err
    if entry not in EXPORTERS:
        methods = ", ".join(sorted(m.split(".")[-2] for m in EXPORTERS))
        saved = run_dir / "model"
        hint = (f"{saved} already holds its trained model for transformers (AutoModelForCausalLM.from_pretrained; "
                "docs/export.md)" if (saved / "config.json").is_file() else None)  # fmt: skip
        raise ConfigError(f"{run_dir} was made by recipe {name!r} ({entry}), which has no exporter; methods with "
                          f"one: {methods}", hint)  # fmt: skip
    return importlib.import_module(EXPORTERS[entry])


def export_run(run_dir: Path, stage: str, outputs: dict[str, Path]) -> dict[str, Path]:
    """Write each requested format of ``stage`` to its folder; returns ``{format: folder}``.

    Raises:
        ConfigError: no output asked for, an unknown stage or a format the method does not export (the
            message names the valid ones).
        RunFolderError: the run folder lacks the stage, or an output folder exists and is not empty.
    """
    run_dir = Path(run_dir)
    mod = exporter_of(run_dir)
    if not outputs:
        raise ConfigError("nothing to export: give an output folder",
                          f"options: {', '.join(option(f) + ' OUT' for f in mod.FORMATS)}")  # fmt: skip
    if stage not in mod.STAGES:
        raise ConfigError(f"unknown stage {stage!r}; valid stages: {', '.join(mod.STAGES)}")
    bad = [f for f in outputs if f not in mod.FORMATS]
    if bad:
        raise ConfigError(f"this method does not export {', '.join(bad)}; formats: {', '.join(mod.FORMATS)} "
                          f"(options {', '.join(option(f) for f in mod.FORMATS)})")  # fmt: skip
    paths = [Path(p).resolve() for p in outputs.values()]
    if len(set(paths)) < len(paths):
        raise ConfigError("each format needs its own output folder; the same folder was given twice",
                          "give each option a new folder")  # fmt: skip
    for fmt, out in outputs.items():
        out = Path(out)
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            what = "is a file" if not out.is_dir() else "exists and is not empty"
            raise RunFolderError(f"{option(fmt)} folder {out} {what}",
                                 "give a new folder, or delete this one first")  # fmt: skip
    mod.check_stage(run_dir, stage)
    return mod.export(run_dir, stage, {fmt: Path(out) for fmt, out in outputs.items()})
