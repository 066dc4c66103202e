"""``train:``: the schedule, optimiser and augmentations every defense shares."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    keep_every: int = field(
        default=0,
        metadata={
            "help": "also keep every N-th epoch's checkpoint of each defense, beside the last two, to study how "
            "training unfolds (reprlab otcclip flag-probe reads them); 0 = the last two only",
            "ge": 0,
        },
    )
