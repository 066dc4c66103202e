"""``poison:``: planting targeted poisons and a backdoor in the user's own image-caption data (``reprlab otcclip
poison``, or the recipe's ``poison`` stage) [ours: the attacks follow RoCLIP and CleanCLIP; the options are ours].
"""

from __future__ import annotations

from dataclasses import dataclass, field

from reprlab.methods.otcclip.config.data import TRIGGERS


@dataclass(frozen=True)
class PoisonConfig:
    enabled: bool = field(
        default=False,
        metadata={
            "help": "[ours] recipe stage 'poison': poison stream.source into <run>/poisoned (as `reprlab otcclip "
            "poison`) and train on that; eval.poison_manifest then defaults to its manifest.json"
        },
    )
    targets: tuple[str, ...] = field(
        default=(), metadata={"help": "targeted poisons: image files to use as targets (needs adv_class)"}
    )
    targets_from: str = field(
        default="",
        metadata={
            "help": "targeted poisons: an ImageFolder (class sub-folders) to pick n_targets targets from, seeded; "
            "keep these images out of the training data (RoCLIP's held-out targets)"
        },
    )
    class_names: str = field(
        default="",
        metadata={
            "help": "JSON of targets_from's class names (list or folder -> name); '' = the folder names"
        },
    )
    n_targets: int = field(default=0, metadata={"help": "targets picked from targets_from", "ge": 0})
    adv_class: str = field(
        default="",
        metadata={
            "help": "the adversarial caption class of every target; '' = a random class other than the target's "
            "own, per target (needs targets_from)"
        },
    )
    captions_per_target: int = field(
        default=0, metadata={"help": "poison pairs per target N (RoCLIP: 100 on CC3M)", "ge": 0}
    )
    targeted_rate: float = field(
        default=0.0,
        metadata={
            "help": "instead of captions_per_target: targeted poison pairs as a share of the clean pairs, split "
            "evenly over the targets",
            "ge": 0,
            "lt": 1,
        },
    )
    caption_source: str = field(
        default="corpus",
        metadata={
            "help": "poison captions: 'corpus' (the data's own captions that name the adversarial class, as "
            "RoCLIP) or 'templates' (CLIP's ImageNet templates with the class name)",
            "choices": ["corpus", "templates"],
        },
    )
    backdoor: int = field(default=0, metadata={"help": "backdoored pairs M", "ge": 0})
    backdoor_rate: float = field(
        default=0.0,
        metadata={
            "help": "instead of backdoor: backdoored pairs as a share of the clean pairs",
            "ge": 0,
            "lt": 1,
        },
    )
    backdoor_target: str = field(
        default="", metadata={"help": "backdoor target class: triggered images get 'a photo of a {target}'"}
    )
    backdoor_mode: str = field(
        default="replace",
        metadata={
            "help": "[ours] 'replace': a backdoored pair replaces the clean pair it was made from (as our "
            "testbed); 'add': it is added beside it",
            "choices": ["replace", "add"],
        },
    )
    trigger: tuple[str, ...] = field(
        default=("badnets",),
        metadata={
            "help": "backdoor trigger(s), one backdoor of `backdoor` pairs each (disjoint): "
            + ", ".join(TRIGGERS)
            + " (data/triggers.py)"
        },
    )
    image_size: int = field(
        default=224,
        metadata={
            "help": "backdoored images are fitted to this square size (shorter side, centre crop) and triggered "
            "there (CleanCLIP: 224); train at this model.image_size and the trigger reaches the model unresampled",
            "ge": 8,
        },
    )
    trigger_patch: int = field(
        default=0,
        metadata={"help": "BadNets patch side in px (0 = CleanCLIP's 16/224 of image_size)", "ge": 0},
    )
    blend_alpha: float = field(
        default=0.2, metadata={"help": "blended trigger weight (CleanCLIP: 0.2)", "gt": 0}
    )
    sig_amplitude: float = field(
        default=60.0, metadata={"help": "SIG amplitude of 255 (CleanCLIP: 60)", "gt": 0}
    )
    sig_frequency: float = field(default=6.0, metadata={"help": "SIG periods across the width", "gt": 0})
    wanet_grid: int = field(default=4, metadata={"help": "WaNet control grid side (WaNet: 4)", "ge": 2})
    wanet_strength: float = field(
        default=0.0,
        metadata={
            "help": "[ours] WaNet's largest displacement in px (0 = our testbed's 3 px at 56, scaled)",
            "ge": 0,
        },
    )
    shard_size: int = field(default=1000, metadata={"help": "samples per output shard", "ge": 1})
    n_shards: int = field(
        default=0,
        metadata={"help": "exactly this many near-equal output shards instead (0 = by shard_size)", "ge": 0},
    )
