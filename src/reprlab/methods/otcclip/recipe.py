"""otcclip-*: one poisoned image-caption dataset, four defenses trained side by side, one comparison.

Setup -> train -> evaluate -> report:

1. Data [ours]: Fashion-MNIST mosaics with compositional captions (``mosaic``), plus targeted poisons
   (held-out test-split targets x N natural captions naming a wrong class) and a BadNets/blended backdoor
   (``poison``), at rates far above web scale because the dataset is tiny (brief §6).
2. Train the same tiny CLIP from the same initialisation under each defense (``trainer``); each epoch
   is checkpointed under the defense's tag and a finished defense is a run stage, so ``--resume``
   continues where a run stopped.
3. Evaluate zero-shot (prompt ensemble), linear probe, ASR_targeted, ASR_backdoor (brief §3) and, for the
   matching defenses, re-matching quality of the last matching epoch.
4. ``report_sections`` rebuilds the table and plots from the saved files only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from reprlab.assets import FASHION_MNIST_CLASSES, fashion_mnist
from reprlab.errors import ConfigError
from reprlab.jsonfile import null_as_nan
from reprlab.methods.otcclip import evaluate as ev
from reprlab.methods.otcclip.model import ModelConfig, build_model, build_tokenizer
from reprlab.methods.otcclip.mosaic import (
    BACKDOOR,
    TARGETED,
    LabeledSet,
    PairSet,
    SignatureIndex,
    class_prompts,
    make_mosaics,
    make_single_items,
)
from reprlab.methods.otcclip.poison import TRIGGERS, TargetSet, add_backdoor, add_targeted, add_wanet_noise
from reprlab.methods.otcclip.shapes import SHAPES, make_shape_items
from reprlab.methods.otcclip.stream import StreamConfig
from reprlab.methods.otcclip.tokenizer import WordTokenizer
from reprlab.methods.otcclip.trainer import AVAILABLE_DEFENSES, DEFENSES, DefenseConfig, TrainConfig, Trainer
from reprlab.report import Section
from reprlab.report.headline import Headline
from reprlab.runs import Run
from reprlab.train.seed import seed_everything

# Fashion-MNIST index ranges [ours]: mosaics draw from train[:50000], the linear probe trains on
# train[50000:], evaluation uses test[:5000] and targets come from test[5000:], so no target image is
# ever trained on (except as a poison) or evaluated as a clean item.
MOSAIC_ITEMS, PROBE_ITEMS, EVAL_ITEMS, TARGET_ITEMS = (
    slice(0, 50000),
    slice(50000, 60000),
    slice(0, 5000),
    slice(5000, 10000),
)


@dataclass(frozen=True)
class DataConfig:
    testbed: str = field(
        default="fashion_mnist",
        metadata={
            "help": "'fashion_mnist' (real items), 'shapes' (generated, tint recommended) or 'none' (train on "
            "stream.source only; no zero-shot / probe / ASR evaluation)"
        },
    )
    n_pairs: int = field(default=2000, metadata={"help": "clean mosaic pairs before poisoning"})
    min_items: int = field(default=1, metadata={"help": "fewest items per mosaic"})
    max_items: int = field(default=4, metadata={"help": "most items per mosaic (<= 4)"})
    tint: bool = field(default=False, metadata={"help": "colour items and name the colour (3 channels)"})
    n_targets: int = field(default=4, metadata={"help": "targeted-poison target images T"})
    captions_per_target: int = field(default=25, metadata={"help": "poison captions per target N"})
    backdoor_pairs: int = field(default=60, metadata={"help": "backdoored training pairs M"})
    backdoor_target: str = field(default="bag", metadata={"help": "backdoor target class name"})
    trigger: str = field(
        default="badnets",
        metadata={
            "help": "backdoor trigger: 'badnets' (corner patch), 'badnets_random' (patch at a random "
            "position per image), 'blended', 'sig' (sinusoid) or 'wanet' (smooth warp)",
            "choices": list(TRIGGERS),
        },
    )
    trigger_patch: int = field(default=8, metadata={"help": "BadNets patch side in px", "ge": 1, "le": 56})
    sig_amplitude: float = field(
        default=60.0, metadata={"help": "SIG amplitude in pixel units of 255 (CleanCLIP: 60/255)", "gt": 0}
    )
    sig_frequency: float = field(
        default=6.0, metadata={"help": "SIG periods across the image width (Barni et al.: 6)", "gt": 0}
    )
    wanet_grid: int = field(default=4, metadata={"help": "WaNet control grid side k (WaNet: 4)", "ge": 2})
    wanet_strength: float = field(
        default=3.0, metadata={"help": "[ours] WaNet's largest displacement in px", "ge": 0}
    )
    wanet_noise_ratio: float = field(
        default=0.0,
        metadata={
            "help": "WaNet noise mode: round(ratio * backdoor_pairs) clean pairs get the trigger warp plus "
            "per-pixel noise and keep their true captions (WaNet's cross_ratio: 2; ours default 0 = off); "
            "trigger 'wanet' only",
            "ge": 0,
        },
    )
    wanet_noise_px: float = field(
        default=0.5,
        metadata={
            "help": "noise-mode per-pixel displacement noise, +- px per axis (WaNet: 1/H grid = 0.5 px)",
            "gt": 0,
        },
    )
    clean_finetune_pairs: int = field(
        default=0,
        metadata={
            "help": "[ours] CleanCLIP's clean fine-tuning set: this many never-poisoned mosaic pairs from another "
            "seed, trained on in CleanCLIP's fine-tuning epochs (other defenses ignore it); 0 = fine-tune on "
            "the poisoned training pairs (the old behaviour)",
            "ge": 0,
        },
    )
    n_eval: int = field(
        default=1000, metadata={"help": "single test items for zero-shot / probe / ASR (<= 5000)"}
    )
    n_probe_train: int = field(default=2000, metadata={"help": "single train items the linear probe fits on"})
    probe_c: float = field(default=1.0, metadata={"help": "LogisticRegression C"})
    probe_max_iter: int = field(default=1000, metadata={"help": "LogisticRegression max_iter"})


@dataclass(frozen=True)
class Config:
    seed: int = field(default=0, metadata={"help": "seed for data, poisons, init and order"})
    device: str = field(default="auto", metadata={"help": "'auto', 'cpu' or 'cuda'"})
    threads: int = field(default=0, metadata={"help": "torch CPU threads (0: torch default)"})
    defenses: tuple[str, ...] = field(default=DEFENSES, metadata={"help": "defenses to train, in order"})
    audit_defense: str = field(
        default="none", metadata={"help": "model the audit is measured with ('' = skip)"}
    )
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    defense: DefenseConfig = field(default_factory=DefenseConfig)
    stream: StreamConfig = field(default_factory=StreamConfig)


@dataclass
class Testbed:
    pairs: PairSet
    targets: TargetSet
    eval_set: LabeledSet
    probe_train: LabeledSet
    backdoor_class: int
    clean: PairSet | None = None  # CleanCLIP's clean fine-tuning set (data.clean_finetune_pairs)
    wanet_noise_rows: torch.Tensor | None = None  # WaNet noise-mode rows of ``pairs``


def trigger_params(cfg: DataConfig) -> dict:
    """The trigger's settings from the data config, as keyword arguments of ``apply_trigger``."""
    return {
        "patch": cfg.trigger_patch,
        "sig_amplitude": cfg.sig_amplitude,
        "sig_frequency": cfg.sig_frequency,
        "wanet_grid": cfg.wanet_grid,
        "wanet_strength": cfg.wanet_strength,
    }


def build_testbed(cfg: DataConfig, seed: int) -> Testbed:
    """The poisoned training set and the evaluation sets, deterministic from ``seed``."""
    if cfg.testbed == "fashion_mnist":
        names = FASHION_MNIST_CLASSES
        x, y = fashion_mnist("train")
        xt, yt = fashion_mnist("test")
    elif cfg.testbed == "shapes":
        names = SHAPES
        x, y = make_shape_items(60000, seed + 10)
        xt, yt = make_shape_items(10000, seed + 11)
    else:
        raise ValueError(f"unknown testbed {cfg.testbed!r}; choose 'fashion_mnist' or 'shapes'")
    if cfg.backdoor_target not in names:
        raise ValueError(f"backdoor_target {cfg.backdoor_target!r} is not one of {names}")
    if not 1 <= cfg.n_eval <= 5000:
        raise ValueError(f"n_eval must be in [1, 5000], got {cfg.n_eval}")
    sigs = SignatureIndex()

    def mosaics(n: int, mosaic_seed: int) -> PairSet:
        return make_mosaics(
            n,
            mosaic_seed,
            cfg.min_items,
            cfg.max_items,
            cfg.tint,
            source=(x[MOSAIC_ITEMS], y[MOSAIC_ITEMS]),
            signatures=sigs,
            class_names=names,
        )

    pairs = mosaics(cfg.n_pairs, seed)
    pairs, targets = add_targeted(
        pairs, xt[TARGET_ITEMS], yt[TARGET_ITEMS], cfg.n_targets, cfg.captions_per_target, seed + 1, cfg.tint
    )
    backdoor_class = names.index(cfg.backdoor_target)
    pairs = add_backdoor(
        pairs, cfg.backdoor_pairs, backdoor_class, cfg.trigger, seed + 2, sigs, **trigger_params(cfg)
    )
    noise_rows = None
    if cfg.wanet_noise_ratio > 0:
        if cfg.trigger != "wanet":
            raise ValueError(f"data.wanet_noise_ratio needs data.trigger=wanet, not {cfg.trigger!r}")
        pairs, noise_rows = add_wanet_noise(
            pairs,
            round(cfg.wanet_noise_ratio * cfg.backdoor_pairs),
            seed + 6,
            seed + 2,  # the backdoor's trigger seed
            cfg.wanet_grid,
            cfg.wanet_strength,
            cfg.wanet_noise_px,
        )
    clean = None
    if cfg.clean_finetune_pairs > 0:
        # [ours] new scenes (seed + 5) from the same item pool as the training mosaics: a clean sample of the
        # training distribution, never poisoned (poisons are built above, on the training pairs only)
        clean = mosaics(cfg.clean_finetune_pairs, seed + 5)
    xe, ye = xt[EVAL_ITEMS][: cfg.n_eval], yt[EVAL_ITEMS][: cfg.n_eval]
    xp, yp = x[PROBE_ITEMS][: cfg.n_probe_train], y[PROBE_ITEMS][: cfg.n_probe_train]
    return Testbed(
        pairs,
        targets,
        make_single_items(xe, ye, seed + 3, cfg.tint),
        make_single_items(xp, yp, seed + 4, cfg.tint),
        backdoor_class,
        clean,
        noise_rows,
    )


def evaluate_model(model, tok: WordTokenizer, bed: Testbed, cfg: Config, probe: bool) -> dict[str, float]:
    """Zero-shot, ASRs and (optionally, it is the slow one) the linear probe."""
    class_emb = ev.class_embeddings(model, tok, class_prompts(bed.pairs.class_names), cfg.model.max_len)
    out = {
        "zeroshot_acc": ev.zero_shot_accuracy(model, bed.eval_set, class_emb),
        "asr_targeted": ev.asr_targeted(model, bed.targets, class_emb),
        "asr_backdoor": ev.asr_backdoor(
            model,
            bed.eval_set,
            bed.backdoor_class,
            cfg.data.trigger,
            cfg.seed + 2,
            class_emb,
            **trigger_params(cfg.data),
        ),
    }
    if probe:
        out["linear_probe_acc"] = ev.linear_probe_accuracy(
            model, bed.probe_train, bed.eval_set, cfg.data.probe_c, cfg.data.probe_max_iter
        )
    return out


def _fit(defense, cfg: Config, run: Run, trainer, model, tok, bed, final_loss: bool = False) -> dict:
    """The epoch loop both trainers share: resume from the defense's last epoch checkpoint, train, evaluate each
    epoch on ``bed`` (skipped when it is ``None``: user data without our testbed), checkpoint; then the final
    metrics plus the last re-matching / split diagnostics."""
    start, history = 0, []
    if run.resume and (state := run.load_checkpoint(trainer.modules(), trainer.optimizers(), tag=defense)):
        start, extra = state
        history, trainer.examples = extra["history"], extra["examples"]
    for epoch in run.progress(range(start, cfg.train.epochs), total=cfg.train.epochs - start, desc=defense):
        stats = trainer.run_epoch(epoch)
        if bed is not None:
            stats.update(evaluate_model(model, tok, bed, cfg, probe=False))
        history.append(stats)
        run.log(epoch, defense=defense, **stats)
        run.logger.info("%s epoch %d: %s", defense, epoch, {k: v for k, v in stats.items() if k != "epoch"})
        run.save_checkpoint(
            epoch + 1,
            trainer.modules(),
            trainer.optimizers(),
            extra={"history": history, "examples": trainer.examples},
            tag=defense,
        )
    final = evaluate_model(model, tok, bed, cfg, probe=True) if bed is not None else {}
    if final_loss:
        final["final_loss"] = history[-1]["loss"] if history else float("nan")
    matches = [h for h in history if "rematch_poison_moved" in h]
    if matches:
        final["rematch_poison_moved"] = matches[-1]["rematch_poison_moved"]
        final["rematch_clean_kept"] = matches[-1]["rematch_clean_kept"]
    splits = [h for h in history if "poison_in_risky" in h]
    if splits:
        final["safeclip_poison_in_risky"] = splits[-1]["poison_in_risky"]
    return final


def train_defense(defense: str, cfg: Config, run: Run, bed: Testbed, tok: WordTokenizer, dist=None) -> dict:
    """Train and evaluate one defense, resuming from its last epoch checkpoint; under torchrun ``dist`` splits
    every global batch across the ranks."""
    torch.manual_seed(cfg.seed)  # same initial weights for every defense
    channels = bed.pairs.images.shape[1]
    model = build_model(cfg.model, len(tok), channels).to(run.device)
    trainer = Trainer(
        model, bed.pairs, tok, defense, cfg.train, cfg.defense, cfg.seed, dist=dist, clean=bed.clean
    )
    final = _fit(defense, cfg, run, trainer, model, tok, bed)
    examples = [dict(e, image=bed.pairs.images[e["index"]].tolist()) for e in trainer.examples]
    return {"metrics": final, "examples": examples}


def streaming(cfg: Config) -> bool:
    """Whether the run trains from a stream (``stream.source`` or ``stream.write_shards``)."""
    return bool(cfg.stream.source) or cfg.stream.write_shards


def trains_on_clean(cfg: Config) -> bool:
    """Whether a defense of the run fine-tunes on a clean set (has ``clean_phases``: CleanCLIP)."""
    from reprlab.methods.otcclip.defenses import REGISTRY

    return any(REGISTRY[d].clean_phases for d in cfg.defenses if d in REGISTRY)


def preflight(cfg: Config) -> None:
    """Checks before a run folder exists: the stream's source exists and is readable data, the options suit the
    trainer, the model's architecture is available, and a clean source a defense trains on holds no item whose
    provenance says poisoned (manifest.json's count, else one pass over the shards' metadata, no image
    decoded)."""
    from reprlab.methods.otcclip.defenses.otcclip import whole_set_options
    from reprlab.methods.otcclip.stream import check_clean_source, open_source

    if cfg.stream.source and cfg.stream.write_shards:
        raise ConfigError("give stream.source or stream.write_shards, not both")
    sc = cfg.stream
    if sc.clean_source and not streaming(cfg):
        raise ConfigError(
            "stream.clean_source needs a stream (stream.source or stream.write_shards); the in-memory testbed's "
            "clean fine-tuning set is data.clean_finetune_pairs"
        )
    d = cfg.defense
    if streaming(cfg) and "otcclip" in cfg.defenses and (opts := whole_set_options(d)):
        raise ConfigError(f"{', '.join(opts)} works with the in-memory trainer only, not with a stream")
    if cfg.data.testbed == "none" and not cfg.stream.source:
        raise ConfigError(
            "stream.source is empty: data.testbed 'none' trains on your data only; set stream.source to a folder "
            "of webdataset .tar shards (e.g. CC3M written by img2dataset) or a CSV/TSV/JSONL of (image, caption)"
        )
    if cfg.stream.source:
        open_source(cfg.stream.source, cfg.stream.image_root)
    if sc.clean_source:
        clean = open_source(sc.clean_source, sc.image_root, key="stream.clean_source")
        if trains_on_clean(cfg):
            check_clean_source(clean)  # only where a defense will train on it
    if cfg.model.arch.startswith("open_clip:"):
        build_model(cfg.model, 2)  # raises ModelNotAvailableError saying why
    elif cfg.model.arch not in ("tiny", "hf_clip"):
        raise ConfigError(f"model.arch {cfg.model.arch!r} is not 'tiny', 'hf_clip' or 'open_clip:<name>'")


def run(cfg: Config, run: Run) -> dict:
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    for d in cfg.defenses:
        if d not in AVAILABLE_DEFENSES:
            raise ConfigError(f"unknown defense {d!r} in defenses; choose from {AVAILABLE_DEFENSES}")
    seed_everything(cfg.seed)
    if streaming(cfg):
        preflight(cfg)  # again: library callers of run() skip the runner's hook
        return run_stream(cfg, run)
    from reprlab.train.dist import init_distributed

    # a plain launch is one rank (the trainer is then unchanged); under torchrun the ranks split each batch
    dist = init_distributed(device="cpu" if run.device.type == "cpu" else None)
    bed = build_testbed(cfg.data, cfg.seed)
    tok = build_tokenizer(cfg.model) or WordTokenizer.from_texts(bed.pairs.captions)
    _save_tokenizer(run, tok)
    data_info = {"n_pairs": len(bed.pairs), "vocab": len(tok), "testbed": cfg.data.testbed}
    data_info.update(_testbed_info(cfg, bed, bed.pairs.kind))
    run.save_json("analysis/data.json", data_info)
    summary: dict[str, float | int | str] = {
        "n_pairs": len(bed.pairs),
        "poison_rate": data_info["poison_rate"],
    }
    results = {}
    for defense in cfg.defenses:
        res = run.stage(defense, lambda d=defense: train_defense(d, cfg, run, bed, tok, dist))
        results[defense] = res["metrics"]
        run.save_json(f"analysis/examples_{defense}.json", res["examples"])
        for key, value in res["metrics"].items():
            summary[f"{defense}.{key}"] = value
    run.save_json("analysis/results.json", results)
    if cfg.audit_defense in cfg.defenses:
        audit = run.stage("audit", lambda: audit_testbed(cfg, run, bed, tok))
        run.save_json("analysis/audit.json", audit)
        summary.update({f"audit.{k}": v for k, v in audit.items() if not isinstance(v, dict | list)})
    return summary


# ---------------------------------------------------------------------- the streamed path
def run_stream(cfg: Config, run: Run) -> dict:
    """Train every defense from a stream (``stream``'s docstring): the testbed written as shards by a first
    stage (``stream.write_shards``) or the user's ``stream.source``; evaluate on the testbed's held-out sets.
    CleanCLIP's clean fine-tuning epochs stream ``stream.clean_source``, else (when a defense trains on it) the
    testbed's ``data.clean_finetune_pairs`` set written as shards by a stage ``clean_shards``."""
    from reprlab.methods.otcclip.shards import write_shards
    from reprlab.methods.otcclip.stream import ShardSource, open_source, vocabulary_texts
    from reprlab.train.dist import init_distributed

    dist = init_distributed(device="cpu" if run.device.type == "cpu" else None)
    sc = cfg.stream
    bed = build_testbed(cfg.data, cfg.seed) if cfg.data.testbed != "none" else None
    clean_source, clean_dir = None, None  # CleanCLIP's clean fine-tuning stream, if any
    if sc.write_shards:
        shard_dir = run.dir / "shards"

        def write() -> dict:
            if run.is_main:
                write_shards(bed.pairs, shard_dir, sc.shard_size, shuffle_seed=cfg.seed)
            return {"n_samples": len(bed.pairs), "shard_size": sc.shard_size}

        run.stage("shards", write)
    if sc.clean_source and trains_on_clean(cfg):  # the user's clean set replaces the testbed's
        clean_source = open_source(sc.clean_source, sc.image_root, key="stream.clean_source")
    elif bed is not None and bed.clean is not None and trains_on_clean(cfg):
        clean_dir = _clean_shards(cfg, run, bed.clean)
    if dist.enabled:
        torch.distributed.barrier()  # rank 0 wrote the shards
    source = ShardSource(run.dir / "shards") if sc.write_shards else open_source(sc.source, sc.image_root)
    if clean_dir is not None:
        clean_source = ShardSource(clean_dir)
    tok = build_tokenizer(cfg.model)
    if tok is None and sc.write_shards:
        tok = WordTokenizer.from_texts(bed.pairs.captions)  # the in-memory path's vocabulary
    elif tok is None:
        names = bed.pairs.class_names if bed else ()
        tok = WordTokenizer.from_texts(
            vocabulary_texts(source, sc.vocab_samples, names, prompts=bed is not None)
        )
    _save_tokenizer(run, tok)
    n_samples = sc.n_samples or source.count()
    channels = _source_channels(source, bed)
    data_info = {
        "source": str(sc.source or run.dir / "shards"),
        "streamed": True,
        "n_pairs": n_samples,
        "vocab": len(tok),
        "testbed": cfg.data.testbed,
        "slots": sc.slots,
        "num_workers": sc.num_workers,
        "window_batches": sc.window_batches,
    }
    if bed is not None:
        kinds = bed.pairs.kind if sc.write_shards else None
        data_info.update(_testbed_info(cfg, bed, kinds))
    if clean_source is not None:
        data_info["clean_source"] = str(sc.clean_source or clean_dir)
    if clean_source is None or sc.clean_source:
        data_info.pop("n_clean_finetune", None)  # the testbed's clean set is not streamed
    run.save_json("analysis/data.json", data_info)
    summary: dict[str, float | int | str] = {"n_pairs": n_samples}
    if "poison_rate" in data_info:
        summary["poison_rate"] = data_info["poison_rate"]
    results = {}
    for defense in cfg.defenses:
        res = run.stage(
            defense,
            lambda d=defense: train_defense_stream(
                d, cfg, run, bed, tok, source, n_samples, channels, dist, clean_source
            ),
        )
        results[defense] = res["metrics"]
        run.save_json(f"analysis/examples_{defense}.json", res["examples"])
        for key, value in res["metrics"].items():
            summary[f"{defense}.{key}"] = value
    run.save_json("analysis/results.json", results)
    return summary


def _save_tokenizer(run: Run, tok) -> None:
    """``artifacts/tokenizer.json``: our word tokenizer's vocabulary, or what identifies open_clip's tokenizer (the
    audit rebuilds a run's tokenizer from it, ``audit.run_tokenizer``); a Hugging Face tokenizer is its
    ``model.tokenizer`` folder and saves nothing."""
    if run.is_main and hasattr(tok, "save"):
        (run.dir / "artifacts").mkdir(parents=True, exist_ok=True)
        tok.save(run.dir / "artifacts" / "tokenizer.json")


def _clean_shards(cfg: Config, run: Run, clean: PairSet) -> Path:
    """Stage ``clean_shards`` [ours]: the testbed's clean fine-tuning set (``data.clean_finetune_pairs``) as shards
    in ``<run>/clean_shards``, the stream's clean source; run only when a defense trains on it (a resumed run
    that adds one writes them then). Near-equal shards, a multiple of ``stream.slots`` of them (every slot gets a
    share however small the set), at most ``stream.shard_size`` each."""
    from reprlab.methods.otcclip.shards import clean_shard_size, write_clean_shards

    sc, out = cfg.stream, run.dir / "clean_shards"

    def write() -> dict:
        if run.is_main:
            write_clean_shards(clean, out, sc.shard_size, sc.slots, cfg.seed)
        return {"n_samples": len(clean), "shard_size": clean_shard_size(len(clean), sc.shard_size, sc.slots)}

    run.stage("clean_shards", write)
    return out


def _source_channels(source, bed: Testbed | None) -> int:
    """Image channels of the data: the testbed's, else manifest.json's image shape (when it lists these shards),
    else RGB."""
    if bed is not None:
        return int(bed.pairs.images.shape[1])
    manifest = source.manifest() if hasattr(source, "manifest") else None
    shape = (manifest or {}).get("image_shape")
    return int(shape[0]) if shape else 3


def _testbed_info(cfg: Config, bed: Testbed, kinds: torch.Tensor | None) -> dict:
    """The report's data fields for the testbed (poison counts only when the stream is the testbed itself)."""
    out = {
        "n_eval": len(bed.eval_set.labels),
        "targets": [
            {"true": bed.pairs.class_names[int(t)], "target": bed.pairs.class_names[int(g)]}
            for t, g in zip(bed.targets.true, bed.targets.target)
        ],
        "backdoor_target": cfg.data.backdoor_target,
        "trigger": cfg.data.trigger,
    }
    if bed.clean is not None:
        out["n_clean_finetune"] = len(bed.clean)
    if bed.wanet_noise_rows is not None:
        out["n_wanet_noise"] = len(bed.wanet_noise_rows)
    if kinds is not None:
        out.update(
            n_clean=int((kinds == 0).sum()),
            n_targeted=int((kinds == TARGETED).sum()),
            n_backdoor=int((kinds == BACKDOOR).sum()),
            poison_rate=float((kinds != 0).float().mean()),
            caption_examples=bed.pairs.captions[:5],
        )
    return out


def train_defense_stream(
    defense, cfg: Config, run: Run, bed, tok, source, n_samples, channels, dist, clean_source=None
) -> dict:
    """Train one defense from the stream (resuming from its last epoch checkpoint) and evaluate it;
    ``clean_source``: CleanCLIP's clean fine-tuning stream (``stream.clean_source`` or the written clean set)."""
    from reprlab.methods.otcclip.stream import StreamTrainer

    torch.manual_seed(cfg.seed)  # same initial weights for every defense
    model = build_model(cfg.model, len(tok), channels).to(run.device)
    trainer = StreamTrainer(
        model,
        source,
        tok,
        defense,
        cfg.train,
        cfg.defense,
        cfg.seed,
        cfg.stream,
        n_samples,
        dist=dist,
        clean=clean_source,
    )
    final = _fit(defense, cfg, run, trainer, model, tok, bed, final_loss=True)
    return {"metrics": final, "examples": trainer.examples}


def audit_testbed(cfg: Config, run: Run, bed: Testbed, tok: WordTokenizer) -> dict:
    """``reprlab otcclip audit`` measured on our poisoned pairs, with the model trained under
    ``cfg.audit_defense`` (the user's situation: a CLIP trained on the data being audited)."""
    from reprlab.methods.otcclip.audit import audit_pairs, precision_recall, write_outputs

    model = build_model(cfg.model, len(tok), bed.pairs.images.shape[1]).to(run.device)
    if run.load_checkpoint({"model": model}, tag=cfg.audit_defense, restore_rng=False) is None:
        raise FileNotFoundError(f"no checkpoint of defense {cfg.audit_defense!r} in {run.dir}")
    d = cfg.defense
    res = audit_pairs(model, tok, bed.pairs, top_k=d.top_k, alpha=d.alpha, ot=d.ot, seed=cfg.seed)
    poison = (bed.pairs.kind != 0).numpy()
    flagged = precision_recall(res, poison)
    at_n = precision_recall(res, poison, top=int(poison.sum()))
    if run.is_main:
        write_outputs(
            run.dir / "audit",
            bed.pairs,
            [f"pair{i}" for i in range(len(bed.pairs))],
            res,
            top=40,
            extra={"flagged": flagged, "top_n_poison": at_n},
        )
    return {
        "model": cfg.audit_defense,
        "precision": flagged["precision"],
        "recall": flagged["recall"],
        "n_flagged": flagged["n_flagged"],
        "precision_at_n_poison": at_n["precision"],
        "ot_max_marginal_error": res.ot_max_marginal_error,
        "ot_converged_share": res.ot_converged_share,
    }


# ---------------------------------------------------------------------- report
def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [null_as_nan(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


# shares of test items or pairs: Wilson intervals over seeds (reprlab.results.intervals)
SUMMARY_KINDS = {"*.zeroshot_acc": "proportion", "*.linear_probe_acc": "proportion", "*.asr_*": "proportion",
                 "*.rematch_*": "proportion", "*.ot_converged_share": "proportion", "poison_rate": "proportion",
                 "audit.precision*": "proportion", "audit.recall": "proportion"}  # fmt: skip
HEADLINE = Headline(
    rows=(("none (undefended)", "none"), ("RoCLIP-style", "roclip"), ("SafeCLIP-style", "safeclip"),
          ("CleanCLIP-style", "cleanclip"), ("OTCCLIP", "otcclip")),
    cols=(("zero-shot accuracy", "zeroshot_acc"), ("linear-probe accuracy", "linear_probe_acc"),
          ("targeted ASR", "asr_targeted"), ("backdoor ASR", "asr_backdoor")),
    pattern="{row}.{col}", corner="defense", caption="Clean accuracy (higher is better) and attack success (lower)")  # fmt: skip


def report_sections(run_dir: Path) -> list[Section]:
    from reprlab.report.figures import pyplot

    plt = pyplot()
    run_dir = Path(run_dir)
    results = null_as_nan(json.loads((run_dir / "analysis" / "results.json").read_text()))
    data = json.loads((run_dir / "analysis" / "data.json").read_text())
    defenses = list(results)
    metrics = (
        "zeroshot_acc",
        "linear_probe_acc",
        "asr_targeted",
        "asr_backdoor",
        "rematch_poison_moved",
        "rematch_clean_kept",
    )
    rows = [{"defense": d, **{m: results[d].get(m, float("nan")) for m in metrics}} for d in defenses]
    sections = []
    gate = results.get("none", {})
    notes = (
        []
        if "n_clean" not in data
        else [
            f"Data [ours]: {data['n_clean']} {data.get('testbed', 'fashion_mnist')} mosaic pairs with generated "
            "compositional captions, "
            f"{data['n_targeted']} targeted-poison pairs ({len(data['targets'])} targets) and {data['n_backdoor']} "
            f"{data['trigger']} backdoor pairs (target '{data['backdoor_target']}'). "
            + (
                "Real Fashion-MNIST item images; scenes and captions are composed by us, not a web corpus."
                if data.get("testbed", "fashion_mnist") == "fashion_mnist"
                else "GENERATED shapes data (not real images)."
            ),
            "Evaluation: single held-out test items (chance = 1 / #classes). ASR per RoCLIP/CleanCLIP "
            "definitions. Re-matching columns: share of poisoned pairs moved off poison captions / clean pairs "
            "kept on a same-content caption, in the last matching epoch [ours].",
        ]
    )
    if data.get("streamed"):
        notes.insert(
            0,
            f"Streamed training data [ours]: {data['n_pairs']} pairs from {data['source']} ({data['slots']} slots, "
            f"{data['num_workers']} DataLoader workers per rank, windows of {data['window_batches']} global batches: "
            "shuffling and SafeCLIP-style splits work per window).",
        )
    if gate and "asr_targeted" in gate:
        attacked = max(gate.get("asr_targeted", 0), gate.get("asr_backdoor", 0))
        notes.append(
            f"Gate: undefended CLIP ASR targeted {gate['asr_targeted']:.2f}, backdoor "
            f"{gate['asr_backdoor']:.2f} ({'attacked' if attacked >= 0.5 else 'NOT successfully attacked'}); "
            f"zero-shot {gate['zeroshot_acc']:.2f}."
        )
    sections.append(
        Section("OTCCLIP vs baselines on the poisoned mosaic testbed", "\n".join(notes), table=rows)
    )

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.4))
    x = np.arange(len(defenses))
    for ax, keys, title in (
        (axes[0], ("asr_targeted", "asr_backdoor"), "attack success rate"),
        (axes[1], ("zeroshot_acc", "linear_probe_acc"), "clean accuracy"),
    ):
        for j, k in enumerate(keys):
            ax.bar(x + (j - 0.5) * 0.38, [results[d].get(k, np.nan) for d in defenses], 0.38, label=k)
        ax.set_xticks(x, defenses)
        ax.set_ylim(0, 1)
        ax.set_title(title)
        ax.set_ylabel("share of test items")
        ax.legend()
    fig.tight_layout()
    sections.append(Section("ASR and accuracy per defense", figure=fig))

    log = _read_jsonl(run_dir / "metrics.jsonl")
    ot_rows = [
        {
            "defense": r["defense"],
            "epoch": r["epoch"],
            "max marginal error": r["ot_max_marginal_error"],
            "converged share": r["ot_converged_share"],
        }
        for r in log
        if "ot_max_marginal_error" in r
    ]
    if ot_rows:
        sections.append(
            Section(
                "Re-matching OT convergence",
                "Largest L1 marginal error of the re-matching OT solves per matching epoch, and the share of solves "
                "within defense.ot.match_tol (null tolerance: judged against 1e-4). Above tolerance the trainer "
                "warns; the ranking of candidates can then depend on solver error.",
                table=ot_rows,
                collapsed=True,
            )
        )
    if log:
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
        for d in defenses:
            pts = [r for r in log if r.get("defense") == d]
            for ax, k in zip(axes, ("zeroshot_acc", "asr_targeted", "asr_backdoor")):
                ax.plot([r["epoch"] for r in pts], [r.get(k, np.nan) for r in pts], marker="o", ms=3, label=d)
                ax.set_title(k)
                ax.set_xlabel("epoch")
        axes[0].legend()
        fig.tight_layout()
        sections.append(
            Section("Training curves", "Evaluated after every epoch (metrics.jsonl).", figure=fig)
        )

    audit_path = run_dir / "analysis" / "audit.json"
    if audit_path.exists():
        a = json.loads(audit_path.read_text())
        sections.append(
            Section(
                "Audit of the poisoned training set [ours, beyond the paper]",
                f"`reprlab otcclip audit` with the model trained under '{a['model']}': a pair is flagged when "
                "another caption beats its own under S = alpha cos - (1 - alpha) OT distance. Poisons = targeted + "
                "backdoor pairs. Full ranking: audit/flagged.csv, thumbnails: audit/audit.html.",
                table=[
                    {
                        "flagged": a["n_flagged"],
                        "precision": a["precision"],
                        "recall": a["recall"],
                        "precision@#poisons": a["precision_at_n_poison"],
                    }
                ],
            )
        )

    for d in ("otcclip", "roclip"):
        path = run_dir / "analysis" / f"examples_{d}.json"
        examples = json.loads(path.read_text()) if path.exists() else []
        if not examples:
            continue
        fig, axes = plt.subplots(1, len(examples), figsize=(2.8 * len(examples), 3.8), squeeze=False)
        for ax, e in zip(axes[0], examples):
            img = np.asarray(e["image"], dtype=np.uint8).transpose(1, 2, 0)
            ax.imshow(img.squeeze(-1) if img.shape[-1] == 1 else img, cmap="gray")
            ax.axis("off")
            tag = {0: "clean", TARGETED: "targeted", BACKDOOR: "backdoor"}[e["kind"]]
            ax.set_title(f"[{tag}]\norig: {_wrap(e['original'])}\nnew: {_wrap(e['reassigned'])}", fontsize=8)
        fig.tight_layout()
        sections.append(Section(f"Re-assigned captions ({d}, last matching epoch)", figure=fig))
    return sections


def _wrap(text: str, width: int = 34) -> str:
    out, line = [], ""
    for w in text.split():
        if len(line) + len(w) + 1 > width:
            out.append(line)
            line = w
        else:
            line = f"{line} {w}".strip()
    return "\n".join([*out, line])
