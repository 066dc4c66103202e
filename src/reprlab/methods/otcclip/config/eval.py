"""``eval:``: evaluation on the user's own labelled images (ImageFolders) and poison manifest [ours: the metrics
are CLIP's zero-shot and linear probe and the RoCLIP / CleanCLIP attack success rates]."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EvalConfig:
    zeroshot_dir: str = field(
        default="",
        metadata={
            "help": "ImageFolder (one sub-folder per class) for zero-shot accuracy and the backdoor ASR's clean "
            "test images; '' = no folder evaluation (a recipe with a testbed evaluates on it)"
        },
    )
    class_names: str = field(
        default="",
        metadata={
            "help": "JSON of the class names: a list in sorted folder order or an object folder -> name; '' = the "
            "folder names ('_' read as a space)"
        },
    )
    templates: str = field(
        default="",
        metadata={
            "help": "zero-shot prompt templates: a file, one per line with '{}' for the class; '' = CLIP's 80 "
            "ImageNet templates"
        },
    )
    probe_train_dir: str = field(
        default="", metadata={"help": "ImageFolder the linear probe is fitted on ('' = no linear probe)"}
    )
    probe_test_dir: str = field(
        default="", metadata={"help": "ImageFolder the linear probe is scored on ('' = eval.zeroshot_dir)"}
    )
    poison_manifest: str = field(
        default="",
        metadata={
            "help": "manifest.json of `reprlab otcclip poison` (or its folder) for both ASRs; '' = the trained "
            "shards' own manifest when it has a poison record (stream.source or the poison stage's)"
        },
    )
    max_per_class: int = field(
        default=0, metadata={"help": "at most this many images per class folder, seeded (0 = all)", "ge": 0}
    )
    every_epoch: bool = field(
        default=False,
        metadata={"help": "also zero-shot and ASRs after every epoch (the probe only at the end)"},
    )
    probe_c: float = field(default=1.0, metadata={"help": "LogisticRegression C", "gt": 0})
    probe_max_iter: int = field(default=1000, metadata={"help": "LogisticRegression max_iter", "ge": 1})
