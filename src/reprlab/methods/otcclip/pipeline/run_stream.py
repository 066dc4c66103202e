"""The streamed path of a run: every defense trained from a stream of shards or a table (``stream.source``, or
the testbed written as shards by a first stage with ``stream.write_shards``), evaluated on the testbed's held-out
sets when there is one.
"""

from __future__ import annotations

from pathlib import Path

import torch

from reprlab.assets import FASHION_MNIST_CLASSES
from reprlab.methods.otcclip.config import Config
from reprlab.methods.otcclip.data.mosaic import class_prompts
from reprlab.methods.otcclip.data.pairs import PairSet
from reprlab.methods.otcclip.data.shards import clean_shard_size, write_clean_shards, write_shards
from reprlab.methods.otcclip.data.sources import ShardSource, open_source
from reprlab.methods.otcclip.data.testbed import Testbed, build_testbed, testbed_info
from reprlab.methods.otcclip.data.tokenizer import WordTokenizer
from reprlab.methods.otcclip.models.build import build_tokenizer
from reprlab.methods.otcclip.models.run_model import save_tokenizer
from reprlab.methods.otcclip.pipeline import user_data
from reprlab.methods.otcclip.pipeline.fit import train_defense_stream
from reprlab.methods.otcclip.pipeline.preflight import trains_on_clean
from reprlab.runs import Run
from reprlab.train.dist import init_distributed


def run_stream(cfg: Config, run: Run) -> dict:
    """Train every defense from a stream (:mod:`..training.stream`): the testbed written as shards by a first
    stage (``stream.write_shards``) or the user's ``stream.source``; evaluate on the testbed's held-out sets.
    CleanCLIP's clean fine-tuning epochs stream ``stream.clean_source``, else (when a defense trains on it) the
    testbed's ``data.clean_finetune_pairs`` set written as shards by a stage ``clean_shards``."""
    dist = init_distributed(device="cpu" if run.device.type == "cpu" else None)
    sc = cfg.stream
    bed = build_testbed(cfg.data, cfg.seed) if cfg.data.testbed not in ("none", "files") else None
    user_source = user_data.prepare(cfg, run)  # the files and poison stages, when asked for
    clean_source, clean_dir = None, None  # CleanCLIP's clean fine-tuning stream, if any
    if sc.write_shards:
        shard_dir = run.dir / "shards"

        def write() -> dict:
            if run.is_main:
                write_shards(bed.pairs, shard_dir, sc.shard_size, shuffle_seed=cfg.seed)
            return {"n_samples": len(bed.pairs), "shard_size": sc.shard_size}

        run.stage("shards", write)
    if sc.clean_source and trains_on_clean(cfg):  # the user's clean set replaces the testbed's
        clean_source = open_source(sc.clean_source, sc.image_root, "stream.clean_source", sc.on_bad_sample)
    elif bed is not None and bed.clean is not None and trains_on_clean(cfg):
        clean_dir = clean_shards(cfg, run, bed.clean)
    if dist.enabled:
        torch.distributed.barrier()  # rank 0 wrote the shards
    if sc.write_shards:
        source = ShardSource(run.dir / "shards", sc.on_bad_sample)
    else:
        source = open_source(user_source, sc.image_root, on_bad=sc.on_bad_sample)
    folder = user_data.folder_eval(cfg, run.dir) if bed is None else None  # errors before any training
    if clean_dir is not None:
        clean_source = ShardSource(clean_dir, sc.on_bad_sample)
    tok = build_tokenizer(cfg.model)
    if tok is None and sc.write_shards:
        tok = WordTokenizer.from_texts(bed.pairs.captions)  # the in-memory path's vocabulary
    elif tok is None:
        names = bed.pairs.class_names if bed else ()
        texts = vocabulary_texts(source, sc.vocab_samples, names, prompts=bed is not None)
        tok = WordTokenizer.from_texts(texts + (folder.prompts() if folder is not None else []))
    save_tokenizer(run, tok)
    n_samples = sc.n_samples or source.count()
    channels = source_channels(source, bed)
    data_info = {
        "source": str(user_source or run.dir / "shards"),
        "streamed": True,
        "channels": channels,
        "n_pairs": n_samples,
        "vocab": len(tok),
        "testbed": cfg.data.testbed,
        "slots": sc.slots,
        "num_workers": sc.num_workers,
        "window_batches": sc.window_batches,
    }
    if bed is not None:
        kinds = bed.pairs.kind if sc.write_shards else None
        data_info.update(testbed_info(cfg.data, bed, kinds))
    if clean_source is not None:
        data_info["clean_source"] = str(sc.clean_source or clean_dir)
    if clean_source is None or sc.clean_source:
        data_info.pop("n_clean_finetune", None)  # the testbed's clean set is not streamed
    if folder is not None:
        data_info.update(folder.info())
    run.save_json("analysis/data.json", data_info)
    summary: dict[str, float | int | str] = {"n_pairs": n_samples}
    if "poison_rate" in data_info:
        summary["poison_rate"] = data_info["poison_rate"]
    results = {}
    for defense in cfg.defenses:
        res = run.stage(
            defense,
            lambda d=defense: train_defense_stream(
                d, cfg, run, bed, tok, source, n_samples, channels, dist, clean_source, folder
            ),
        )
        results[defense] = res["metrics"]
        run.save_json(f"analysis/examples_{defense}.json", res["examples"])
        for key, value in res["metrics"].items():
            summary[f"{defense}.{key}"] = value
    run.save_json("analysis/results.json", results)
    return summary


def clean_shards(cfg: Config, run: Run, clean: PairSet) -> Path:
    """Stage ``clean_shards`` [ours]: the testbed's clean fine-tuning set (``data.clean_finetune_pairs``) as shards
    in ``<run>/clean_shards``, the stream's clean source; run only when a defense trains on it (a resumed run
    that adds one writes them then). Near-equal shards, a multiple of ``stream.slots`` of them (every slot gets a
    share however small the set), at most ``stream.shard_size`` each."""
    sc, out = cfg.stream, run.dir / "clean_shards"

    def write() -> dict:
        if run.is_main:
            write_clean_shards(clean, out, sc.shard_size, sc.slots, cfg.seed)
        return {"n_samples": len(clean), "shard_size": clean_shard_size(len(clean), sc.shard_size, sc.slots)}

    run.stage("clean_shards", write)
    return out


def source_channels(source, bed: Testbed | None) -> int:
    """Image channels of the data: the testbed's, else manifest.json's image shape (when it lists these shards),
    else RGB."""
    if bed is not None:
        return int(bed.pairs.images.shape[1])
    manifest = source.manifest() if hasattr(source, "manifest") else None
    shape = (manifest or {}).get("image_shape")
    return int(shape[0]) if shape else 3


def vocabulary_texts(
    source, limit: int, class_names=FASHION_MNIST_CLASSES, prompts: bool = True
) -> list[str]:
    """Captions (text only, no image decoded) to build a word vocabulary from, plus the evaluation prompts."""
    texts = source.captions(limit)
    if prompts:
        texts += [p for row in class_prompts(class_names) for p in row]
    return texts
