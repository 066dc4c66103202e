"""Checks a run passes before its run folder exists (the recipe's ``preflight``), and the two facts of a
config that choose the run's path: whether it streams, and whether a defense trains on a clean set.
"""

from __future__ import annotations

from reprlab.errors import ConfigError
from reprlab.methods.otcclip.config import Config, whole_set_options
from reprlab.methods.otcclip.data.sources import (
    check_clean_source,
    check_shard_heads,
    check_slots,
    open_source,
)
from reprlab.methods.otcclip.defenses import REGISTRY
from reprlab.methods.otcclip.models.build import build_model


def streaming(cfg: Config) -> bool:
    """Whether the run trains from a stream (``stream.source`` or ``stream.write_shards``)."""
    return bool(cfg.stream.source) or cfg.stream.write_shards or cfg.data.testbed == "files"


def trains_on_clean(cfg: Config) -> bool:
    """Whether a defense of the run fine-tunes on a clean set (has ``clean_phases``: CleanCLIP)."""
    return any(REGISTRY[d].clean_phases for d in cfg.defenses if d in REGISTRY)


def preflight(cfg: Config) -> None:
    """Checks before a run folder exists: the stream's source exists and is readable data with a shard per slot,
    the options suit the trainer and each defense (:meth:`~..defenses.base.Defense.check`), the model's
    architecture is available, and a clean source a defense trains on holds no item whose provenance says
    poisoned (manifest.json's count, else one pass over the shards' metadata, no image decoded)."""
    if cfg.stream.source and cfg.stream.write_shards:
        raise ConfigError(
            "give stream.source or stream.write_shards, not both",
            hint="to stream your own data with a recipe that writes the testbed's shards (otcclip-shards-tiny), "
            "add stream.write_shards=false",
        )
    sc = cfg.stream
    if sc.clean_source and not streaming(cfg):
        raise ConfigError(
            "stream.clean_source needs a stream (stream.source or stream.write_shards); the in-memory testbed's "
            "clean fine-tuning set is data.clean_finetune_pairs"
        )
    d = cfg.defense
    if streaming(cfg) and "otcclip" in cfg.defenses and (opts := whole_set_options(d)):
        raise ConfigError(f"{', '.join(opts)} works with the in-memory trainer only, not with a stream")
    if streaming(cfg) and (free := [n for n in cfg.defenses if n in REGISTRY and REGISTRY[n].poison_free]):
        raise ConfigError(
            f"defense {free[0]!r} trains on the pairs not marked as poisons and works with the in-memory testbed "
            "only, not with a stream; remove it from defenses"
        )
    for name in cfg.defenses:  # all of them, before the first defense trains
        if name not in REGISTRY:
            raise ConfigError(f"defenses: unknown defense {name!r}; choose from {list(REGISTRY)}")
        REGISTRY[name].check(d)
    user_data_checks(cfg)
    if cfg.data.testbed == "none" and not cfg.stream.source:
        raise ConfigError(
            "stream.source is empty: data.testbed 'none' trains on your data only; set stream.source to a folder "
            "of webdataset .tar shards (e.g. CC3M written by img2dataset) or a CSV/TSV/JSONL of (image, caption)"
        )
    if cfg.stream.source:
        source = open_source(cfg.stream.source, cfg.stream.image_root)
        check_slots(source, "stream.source", sc.slots)
        check_shard_heads(source, "stream.source", sc.on_bad_sample)
    if sc.clean_source:
        clean = open_source(sc.clean_source, sc.image_root, key="stream.clean_source")
        check_shard_heads(clean, "stream.clean_source", sc.on_bad_sample)
        if trains_on_clean(cfg):
            check_slots(clean, "stream.clean_source", sc.slots)
            check_clean_source(clean)  # only where a defense will train on it
    if cfg.model.arch.startswith("open_clip:"):
        build_model(cfg.model, 2)  # raises ModelNotAvailableError saying why
    elif cfg.model.arch not in ("tiny", "hf_clip"):
        raise ConfigError(f"model.arch {cfg.model.arch!r} is not 'tiny', 'hf_clip' or 'open_clip:<name>'")


def user_data_checks(cfg: Config) -> None:
    """The files testbed, the poison stage and the folder evaluation: options that fit together, folders and
    files that exist (indexed, nothing decoded)."""
    from dataclasses import replace

    from reprlab.methods.otcclip.data.folder import image_folder
    from reprlab.methods.otcclip.evaluation.folder import FolderEval

    d, p, e = cfg.data, cfg.poison, cfg.eval
    if d.testbed == "files" and (cfg.stream.source or cfg.stream.write_shards):
        raise ConfigError(
            "data.testbed 'files' writes its own data: leave stream.source '' and write_shards off"
        )
    if p.enabled and cfg.stream.write_shards:
        raise ConfigError(
            "poison.enabled poisons your data (stream.source); the testbed's shards are poisoned already"
        )
    if p.enabled and not cfg.stream.source and d.testbed != "files":
        raise ConfigError("poison.enabled needs stream.source: the shards or table to poison")
    if e.zeroshot_dir and d.testbed not in ("none", "files"):
        raise ConfigError(
            f"eval.zeroshot_dir evaluates on your folders; data.testbed {d.testbed!r} evaluates on its own sets",
            hint="set data.testbed=none to train on stream.source and evaluate on eval.zeroshot_dir",
        )
    if p.enabled and p.targets_from:
        image_folder(p.targets_from, p.class_names, key="poison.targets_from")
    if (
        e.zeroshot_dir
    ):  # the poison stage's manifest does not exist yet: the folders only, and a given manifest
        FolderEval(replace(e, poison_manifest=e.poison_manifest), "", cfg.seed)
