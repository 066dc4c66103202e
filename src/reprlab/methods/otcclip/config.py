"""The recipe's configuration: one frozen dataclass per YAML section, composed into :class:`Config`.

``reprlab run otcclip-*`` resolves a YAML recipe plus ``key=value`` overrides into one ``Config`` before anything
runs; every part of the package receives the section it needs from it (``cfg.model`` to the model builder,
``cfg.train`` and ``cfg.defense`` to the trainer, ...) and none reads configuration anywhere else. Each field's
``help`` says whose choice its default is ([ours] where the papers give none). The defense knobs live beside the
defenses (:mod:`.defenses.config`), as every defense reads them and nothing else does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from reprlab.methods.otcclip.data.triggers import TRIGGERS


@dataclass(frozen=True)
class ModelConfig:
    arch: str = field(
        default="tiny",
        metadata={
            "help": "'tiny' (our TinyCLIP), 'hf_clip' (a transformers CLIPModel built from the sizes below, random "
            "init: ViT-B/32 = image 224, patch 32, width 768, 12 layers, 12 heads; text 512, 12 layers, 8 heads; "
            "embed 512) or 'open_clip:<name>': an open_clip model config name (ViT-B-32, RN50, ... random init), "
            "'reprlab-tiny-vit' (the CPU recipe's tiny ViT), a model config .json or a local-dir folder; its own "
            "sizes, tokenizer and preprocess_cfg, the sizes below ignored (needs open-clip-torch, which does not "
            "import beside this torch build: run it in the side venv of scripts/openclip_env.sh)"
        },
    )
    tokenizer: str = field(
        default="",
        metadata={
            "help": "hf_clip only: a local Hugging Face tokenizer folder (CLIP's BPE; text pooled at EOS, as CLIP); "
            "'' = our word tokenizer built from the captions, text mean-pooled [ours]"
        },
    )
    pretrained: str = field(
        default="",
        metadata={
            "help": "open_clip only [ours]: a local checkpoint file (open_clip state dict) to start from; '' = random "
            "init (hub tags are never downloaded)"
        },
    )
    image_size: int = field(default=56, metadata={"help": "input side in pixels"})
    patch_size: int = field(
        default=7, metadata={"help": "ViT patch side; (image_size/patch_size)^2 patch tokens"}
    )
    width: int = field(default=64, metadata={"help": "image transformer width"})
    layers: int = field(default=2, metadata={"help": "image transformer layers"})
    heads: int = field(default=4, metadata={"help": "image transformer heads"})
    text_width: int = field(default=64, metadata={"help": "text transformer width"})
    text_layers: int = field(default=2, metadata={"help": "text transformer layers"})
    text_heads: int = field(default=4, metadata={"help": "text transformer heads"})
    max_len: int = field(default=32, metadata={"help": "caption length in tokens (longer is truncated)"})
    embed_dim: int = field(default=64, metadata={"help": "joint embedding dimension"})
    feature_layer: int = field(
        default=-1,
        metadata={
            "help": "[ours; tiny only] block whose output gives the fine-grained features (patches, word tokens) "
            "used by OT, Python-indexed over the blocks (-1 = last, -2 = the one before, ...), passed through "
            "the same final LayerNorm and projection; the global embeddings always come from the last block"
        },
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
class StreamConfig:
    source: str = field(
        default="",
        metadata={
            "help": "training data to stream: a folder of webdataset .tar shards, one .tar, or a CSV/TSV/JSONL of "
            "(image path, caption); '' = the in-memory testbed (or the shards written by write_shards)"
        },
    )
    write_shards: bool = field(
        default=False,
        metadata={
            "help": "[ours] first stage: write the recipe's poisoned testbed as shards into <run>/shards "
            "(as `reprlab otcclip make-shards`) and train by streaming them"
        },
    )
    clean_source: str = field(
        default="",
        metadata={
            "help": "[ours] CleanCLIP's clean fine-tuning data, streamed instead of stream.source in the defense's "
            "clean phases (same formats; e.g. `reprlab otcclip make-shards --clean-finetune-pairs`); other "
            "defenses ignore it; replaces the testbed's data.clean_finetune_pairs set (which, when this is '', "
            "is written as shards and streamed); '' and no such set = fine-tune on stream.source"
        },
    )
    shard_size: int = field(
        default=265, metadata={"help": "samples per shard written by write_shards", "ge": 1}
    )
    image_root: str = field(
        default="",
        metadata={
            "help": "folder a table's image paths are relative to, for stream.source and stream.clean_source "
            "('' = each table's own folder)"
        },
    )
    slots: int = field(
        default=2,
        metadata={
            "help": "[ours] logical sub-streams; fixes the data order whatever the ranks and workers (must divide "
            "train.batch_size, be a multiple of the world size, and not exceed the shard count)",
            "ge": 1,
        },
    )
    num_workers: int = field(
        default=2,
        metadata={
            "help": "DataLoader workers per rank (0 = in-process); lowered to the largest count that splits the "
            "rank's slots evenly"
        },
    )
    persistent_workers: bool = field(
        default=True,
        metadata={
            "help": "keep the DataLoader workers alive across epochs (the epoch reaches them through shared memory) "
            "instead of starting them again every epoch"
        },
    )
    window_batches: int = field(
        default=10,
        metadata={
            "help": "[ours] global batches per window: the unit of shuffling and of SafeCLIP-style splits; "
            "memory holds one window of images per rank",
            "ge": 1,
        },
    )
    shuffle_shards: bool = field(default=True, metadata={"help": "permute the shard order every epoch"})
    shuffle_buffer: int = field(
        default=0, metadata={"help": "per-slot shuffle buffer in samples [ours; 0 = file order]", "ge": 0}
    )
    n_samples: int = field(
        default=0,
        metadata={
            "help": "samples per epoch for the learning-rate schedule (0 = manifest.json's n_samples, or one "
            "counting pass over a table / the shards)",
            "ge": 0,
        },
    )
    vocab_samples: int = field(
        default=200_000,
        metadata={
            "help": "[ours] captions read (text only) to build the word vocabulary of a user source",
            "ge": 1,
        },
    )


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = field(default=12, metadata={"help": "training epochs per defense"})
    batch_size: int = field(default=128, metadata={"help": "global batch (split across ranks)"})
    lr: float = field(default=1e-3, metadata={"help": "peak AdamW learning rate"})
    weight_decay: float = field(
        default=0.1, metadata={"help": "AdamW weight decay (RoCLIP: 0.1) on matrices"}
    )
    warmup_steps: int = field(default=50, metadata={"help": "linear warm-up steps, then cosine decay"})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "final lr / peak lr"})
    grad_clip: float = field(default=1.0, metadata={"help": "gradient-norm clip"})
    shift: int = field(
        default=2,
        metadata={
            "help": "max random translation in px [ours: no flips/crops, "
            "they would falsify 'left/right' captions]"
        },
    )
    brightness: float = field(default=0.2, metadata={"help": "random brightness scale +- this"})
    word_dropout: float = field(default=0.1, metadata={"help": "EDA-style random word deletion probability"})
