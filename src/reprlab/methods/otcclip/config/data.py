"""``data:``: the testbed and its poisons [ours: the offline testbed; the attacks follow RoCLIP and CleanCLIP]."""

from __future__ import annotations

from dataclasses import dataclass, field

# the backdoor triggers :mod:`..data.triggers` implements (``data.trigger``'s choices)
TRIGGERS = ("badnets", "badnets_random", "blended", "sig", "wanet")


@dataclass(frozen=True)
class DataConfig:
    testbed: str = field(
        default="fashion_mnist",
        metadata={
            "help": "'fashion_web' [ours] (real items, one per image with scale/placement/brightness/noise, "
            "paraphrased captions with attributes and alt-text noise: docs/otcclip_testbed.md), "
            "'fashion_mnist' (real items in 2x2 mosaics), 'shapes' (generated, tint recommended), 'none' (train on "
            "stream.source only; evaluated on the eval.* folders if given) or 'files' [ours]: Fashion-MNIST written "
            "as a user's PNG files + captions.csv + ImageFolders (n_pairs training images, n_probe_train probe "
            "images, n_eval test images), streamed and evaluated on those folders",
            "choices": ["fashion_web", "fashion_mnist", "shapes", "none", "files"],
        },
    )
    n_pairs: int = field(
        default=2000, metadata={"help": "clean pairs (mosaics or web-like items) before poisoning"}
    )
    caption_noise: float = field(
        default=0.1,
        metadata={
            "help": "[ours] fashion_web only: share of clean pairs whose caption is alt-text noise (generic or "
            "another class's)",
            "ge": 0,
            "le": 1,
        },
    )
    caption_noise_wrong: float = field(
        default=0.5,
        metadata={
            "help": "[ours] fashion_web only: share of the noisy captions that describe another class (the rest "
            "are generic: 'product photo')",
            "ge": 0,
            "le": 1,
        },
    )
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
