"""Typer sub-app mounted by the main CLI as ``reprlab otcclip audit | make-shards | poison | evaluate | flag-probe``
(command bodies in ``pipeline/``)."""

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
    from reprlab.methods.otcclip.pipeline.audit import audit_dataset

    summary = audit_dataset(
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


@app.command("make-shards")
def make_shards(
    out: Path = typer.Argument(..., help="output folder for the .tar shards and manifest.json"),
    n_pairs: int = typer.Option(2000, min=1, help="clean mosaic pairs before poisoning"),
    shard_size: int = typer.Option(500, min=1, help="samples per shard"),
    seed: int = typer.Option(0, help="seed of the mosaics and poisons (as the recipe's seed)"),
    max_items: int = typer.Option(2, min=1, max=4, help="most items per mosaic"),
    clean: bool = typer.Option(False, "--clean", help="clean mosaics only (no targeted/backdoor poisons)"),
    trigger: str = typer.Option("badnets", help="backdoor trigger (see data.trigger)"),
    shuffle: bool = typer.Option(
        True, help="write the pairs in a seeded random order (poisons spread over the shards, as in web data)"
    ),
    clean_finetune_pairs: int = typer.Option(
        0,
        min=0,
        help="[ours] also write CleanCLIP's clean fine-tuning set: this many never-poisoned mosaic pairs, built "
        "as data.clean_finetune_pairs builds them in memory, for stream.clean_source",
    ),
    clean_out: Path = typer.Option(None, help="folder for the clean fine-tuning shards (default: OUT-clean)"),
    clean_slots: int = typer.Option(
        2,
        min=1,
        help="the stream.slots the clean shards will be read with: they are written as a multiple of it, of at "
        "most --shard-size samples (a small clean set still gives every slot a share)",
    ),
) -> None:
    """Write Fashion-MNIST mosaics (poisoned as in otcclip-mosaic-tiny unless --clean) as webdataset tar shards, and
    optionally a clean fine-tuning shard set (--clean-finetune-pairs) into a separate folder."""
    from reprlab.errors import ConfigError
    from reprlab.methods.otcclip.config import DataConfig
    from reprlab.methods.otcclip.data.shards import write_clean_shards, write_shards
    from reprlab.methods.otcclip.data.testbed import build_testbed
    from reprlab.methods.otcclip.data.triggers import TRIGGERS

    if trigger not in TRIGGERS:
        raise ConfigError(f"--trigger {trigger!r} is not one of {list(TRIGGERS)}")
    cfg = DataConfig(  # otcclip-mosaic-tiny's poisons
        n_pairs=n_pairs,
        max_items=max_items,
        captions_per_target=30,
        backdoor_pairs=min(120, n_pairs // 4),
        trigger=trigger,
        clean_finetune_pairs=clean_finetune_pairs,
        n_eval=1,
        n_probe_train=1,
    )
    clean_out = clean_out or out.with_name(out.name + "-clean")
    if clean_finetune_pairs and clean_out.resolve() == out.resolve():
        raise ConfigError(
            "--clean-out must be another folder than OUT: the two shard sets are separate sources"
        )
    bed = build_testbed(cfg, seed) if clean_finetune_pairs or not clean else None
    if clean:
        from reprlab.assets import fashion_mnist
        from reprlab.methods.otcclip.data.mosaic import make_mosaics
        from reprlab.methods.otcclip.data.testbed import MOSAIC_ITEMS

        x, y = fashion_mnist("train")
        pairs = make_mosaics(n_pairs, seed, 1, max_items, source=(x[MOSAIC_ITEMS], y[MOSAIC_ITEMS]))
    else:
        pairs = bed.pairs
    paths = write_shards(pairs, out, shard_size, shuffle_seed=seed if shuffle else None)
    typer.echo(f"wrote {len(pairs)} samples in {len(paths)} shards to {out}")
    if clean_finetune_pairs:
        # the testbed's own clean set (seed + 5 scenes, never poisoned): the same pairs the in-memory recipe
        # fine-tunes CleanCLIP on with data.clean_finetune_pairs at this seed
        paths = write_clean_shards(bed.clean, clean_out, shard_size, clean_slots, seed if shuffle else None)
        typer.echo(f"wrote {len(bed.clean)} clean fine-tuning samples in {len(paths)} shards to {clean_out}")


@app.command("poison")
def poison(
    data: str = typer.Argument(
        ...,
        help="webdataset shards (a folder, one .tar, or a brace pattern shard-{000000..000009}.tar) or a "
        "CSV/TSV/JSONL of (image path, caption)",
    ),
    out: Path = typer.Argument(
        ..., help="new folder for the poisoned .tar shards, targets/ and manifest.json"
    ),
    target: list[str] = typer.Option(
        None, "--target", help="a target image file (repeat; needs --adv-class)"
    ),
    targets_from: str = typer.Option(
        "", help="ImageFolder (class sub-folders) to pick --n-targets targets from"
    ),
    n_targets: int = typer.Option(0, min=0, help="targets picked from --targets-from (seeded)"),
    class_names: str = typer.Option("", help="JSON of --targets-from's class names ('' = folder names)"),
    adv_class: str = typer.Option("", help="adversarial caption class ('' = random other class per target)"),
    captions_per_target: int = typer.Option(
        0, "--captions-per-target", "-n", min=0, help="poison pairs per target"
    ),
    targeted_rate: float = typer.Option(
        0.0, min=0.0, help="or: targeted pairs as a share of the clean pairs"
    ),
    caption_source: str = typer.Option(
        "corpus", help="'corpus' (the data's captions naming the class) or 'templates'"
    ),
    backdoor: int = typer.Option(0, min=0, help="backdoored pairs"),
    backdoor_rate: float = typer.Option(
        0.0, min=0.0, help="or: backdoored pairs as a share of the clean pairs"
    ),
    backdoor_target: str = typer.Option("", help="class the backdoor captions name"),
    backdoor_mode: str = typer.Option(
        "replace", help="'replace' the clean pair, or 'add' the poison beside it"
    ),
    trigger: list[str] = typer.Option(
        None,
        help="badnets (default), badnets_random, blended, sig or wanet; repeat for one backdoor per trigger",
    ),
    image_size: int = typer.Option(224, min=8, help="backdoored images fitted to this size, then triggered"),
    trigger_patch: int = typer.Option(0, min=0, help="BadNets patch side (0 = 16/224 of --image-size)"),
    shard_size: int = typer.Option(1000, min=1, help="samples per output shard"),
    n_shards: int = typer.Option(
        0, min=0, help="exactly this many output shards instead (0 = by --shard-size)"
    ),
    image_root: str = typer.Option(
        "", help="folder a table's image paths are relative to ('' = the table's)"
    ),
    seed: int = typer.Option(0, help="seed of the choices (targets, pairs, places) and of the trigger"),
) -> None:
    """Plant targeted poisons and a backdoor in your image-caption data; write them as shards with a manifest.json
    of exactly what was planted (read by `reprlab otcclip evaluate` and the recipes' eval.poison_manifest).
    Clean samples are copied byte for byte."""
    from reprlab.config.load import load_config
    from reprlab.methods.otcclip.config import PoisonConfig
    from reprlab.methods.otcclip.pipeline.poison import poison_command

    cfg = load_config(PoisonConfig, dict(  # the config's checks: ranges and choices, naming the option
        targets=list(target or ()), targets_from=targets_from, n_targets=n_targets, class_names=class_names,
        adv_class=adv_class, captions_per_target=captions_per_target, targeted_rate=targeted_rate,
        caption_source=caption_source, backdoor=backdoor, backdoor_rate=backdoor_rate,
        backdoor_target=backdoor_target, backdoor_mode=backdoor_mode, trigger=list(trigger or ['badnets']),
        image_size=image_size,
        trigger_patch=trigger_patch, shard_size=shard_size, n_shards=n_shards,
    ))  # fmt: skip
    summary = poison_command(data, out, cfg, seed, image_root)
    typer.echo(json.dumps(summary, indent=2))
    typer.echo(
        f"wrote {summary['n_samples']} samples in {summary['n_shards']} shards and manifest.json to {out}"
    )


@app.command("evaluate")
def evaluate(
    run_dir: Path = typer.Argument(..., help="an otcclip run folder"),
    zeroshot: str = typer.Option("", "--zeroshot", help="ImageFolder for zero-shot and the backdoor ASR"),
    class_names: str = typer.Option("", help="JSON of class names (list or folder -> name)"),
    templates: str = typer.Option("", help="prompt template file ('clip80' = CLIP's 80 ImageNet templates)"),
    probe_train: str = typer.Option("", help="ImageFolder the linear probe is fitted on"),
    probe_test: str = typer.Option(
        "", help="ImageFolder the linear probe is scored on (default: --zeroshot)"
    ),
    manifest: str = typer.Option("", help="poison manifest.json (or its folder) for both ASRs"),
    max_per_class: int = typer.Option(None, min=0, help="at most this many images per class (0 = all)"),
    defense: list[str] = typer.Option(None, "--defense", help="only these defenses (repeat; default: all)"),
    out: Path = typer.Option(None, help="folder for folder_eval.json (default: RUN_DIR/eval)"),
) -> None:
    """Evaluate a run's defenses on your labelled images: zero-shot, linear probe, and the targeted and backdoor
    ASRs of a poison manifest. Options left out take the run's eval.* settings."""
    from reprlab.methods.otcclip.pipeline.evaluate import evaluate_run, table

    overrides = {
        "zeroshot_dir": zeroshot, "class_names": class_names, "templates": templates,
        "probe_train_dir": probe_train, "probe_test_dir": probe_test, "poison_manifest": manifest,
        "max_per_class": max_per_class,
    }  # fmt: skip
    summary = evaluate_run(run_dir, overrides, defense or None, out)
    typer.echo(table(summary))
    typer.echo(f"wrote {(out or run_dir / 'eval') / 'folder_eval.json'}")


@app.command("flag-probe")
def flag_probe(
    run_dir: Path = typer.Argument(
        ..., help="an otcclip run folder on a built-in testbed, trained with train.keep_every"
    ),
    epochs: str = typer.Option(
        ..., help="comma-separated epochs whose kept checkpoints to read, e.g. 6,10,14"
    ),
    defense: str = typer.Option("otcclip", help="which of the run's defenses"),
    n_blend: int = typer.Option(8, min=1, help="training images each flagged image is blended into"),
) -> None:
    """Which feature test tells the flagged backdoor poisons from the flagged clean pairs, epoch by epoch (AUROC;
    the testbed's poison labels are read, so this is a diagnostic of the flag, not a defense)."""
    from reprlab.methods.otcclip.pipeline.flag_probe import probe_run, table

    try:
        wanted = [int(e) for e in epochs.split(",") if e.strip()]
    except ValueError:
        raise typer.BadParameter(f"--epochs takes comma-separated integers, got {epochs!r}") from None
    if not wanted:
        raise typer.BadParameter(f"--epochs names no epoch: {epochs!r}")
    typer.echo(table(probe_run(run_dir, wanted, defense, n_blend)))
