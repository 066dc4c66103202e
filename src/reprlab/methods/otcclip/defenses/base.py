"""The defense interface: what a defense does to a batch's caption assignment, which losses it adds, what
it logs [ours: the structure; each defense's content cites its source in its own file].

A defense is a :class:`Defense` subclass in its own module of this package, decorated with
:func:`register`. The :class:`~reprlab.methods.otcclip.trainer.Trainer` owns everything the defenses share
(data order, augmentation noise, optimiser and schedule, the caption bank's storage, gradient sync) and asks
the defense, per epoch, for its phase, an optional epoch-start action (SafeCLIP's split) and a learning-rate
scale, and per step for a :class:`StepOutput`: the loss, its named terms (logged as epoch means) and, when
the defense re-assigned captions, an :class:`Assignment` (used for re-matching diagnostics and the
re-assigned-caption examples, never by the defense itself).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from reprlab.methods.otcclip.losses import OTConfig, clip_loss
from reprlab.train.dist import all_gather_with_grad

if TYPE_CHECKING:  # the trainer imports this module; only type hints go the other way
    from reprlab.methods.otcclip.trainer import Trainer


@dataclass(frozen=True)
class DefenseConfig:
    """Defense knobs. Every OTCCLIP value is [unknown] in the paper; defaults are ours (brief §2)."""

    bank_size: int = field(default=4096, metadata={"help": "FIFO caption bank (RoCLIP default 21,845)"})
    top_k: int = field(default=16, metadata={"help": "OTCCLIP shortlist size by global cosine"})
    alpha: float = field(default=0.5, metadata={"help": "S = alpha cos - (1 - alpha) D_OT"})
    rematch_every: int = field(default=2, metadata={"help": "period R of matching epochs (RoCLIP: 2)"})
    rematch_warmup: int = field(default=2, metadata={"help": "W epochs before the first matching epoch"})
    include_own: bool = field(
        default=True,
        metadata={"help": "[ours] the image's own caption is always an OTCCLIP candidate and wins ties"},
    )
    keep_margin: float = field(
        default=0.0,
        metadata={"help": "[ours] replace the own caption only when another scores this much higher"},
    )
    detach_matched_text: bool = field(
        default=True,
        metadata={
            "help": "[ours, following RoCLIP] on matching "
            "epochs the re-assigned captions' features are "
            "detached pool entries (no text gradient), so a "
            "wrong match cannot drag the text encoder"
        },
    )
    matched_text: str = field(
        default="pool",
        metadata={
            "help": "[ours] what a matching epoch trains each image with: 'pool' = its assigned pool caption "
            "(detached unless detach_matched_text=false); 'kept_grad' = as 'pool', but images that keep their "
            "own caption train it with text gradient (a fresh forward); 'drop' = as 'kept_grad' for kept "
            "captions, while images whose caption was re-assigned leave the CLIP and inter-OT losses for that "
            "step (filtered, like SafeCLIP's risky set; the intra term still trains them)",
            "choices": ["pool", "kept_grad", "drop"],
        },
    )
    match_lr_scale: float = field(
        default=1.0,
        metadata={
            "help": "[ours] OTCCLIP learning-rate multiplier on matching epochs: re-matching feeds back on "
            "itself within an epoch (images trained toward re-assigned captions rank their own captions lower "
            "a few steps later), and a smaller step slows that loop",
            "gt": 0,
        },
    )
    own_negatives: str = field(
        default="keep",
        metadata={
            "help": "[ours, fourth ablation pass] OTCCLIP CLIP loss: 'keep' = every other column is a negative "
            "(as before); 'mask_own' = a column whose caption is the row image's own training caption (the same "
            "pair's caption, from the batch or a bank copy of it) is masked out in both directions, so the own "
            "caption is never a negative for its image; 'mask_text' = as 'mask_own', for every caption with the "
            "same raw text as the own caption (exact duplicates; no provenance is read)",
            "choices": ["keep", "mask_own", "mask_text"],
        },
    )
    reassigned_weight: float = field(
        default=1.0,
        metadata={
            "help": "[ours, fourth ablation pass] on matching epochs, weight of the CLIP (row and column) and "
            "inter-OT terms of images whose caption was re-assigned to another pair's caption (1 = as before; "
            "0 = they train only as negatives and through the intra OT term)",
            "ge": 0,
            "le": 1,
        },
    )
    match_schedule: str = field(
        default="step",
        metadata={
            "help": "[ours, fourth ablation pass] 'step' = re-match every step of a matching epoch over the "
            "batch + bank with the current model (as before); 'epoch_start' = re-match all training pairs once "
            "at the start of a matching epoch, over all training captions, with the epoch-start model "
            "(un-augmented images and captions), and train the whole epoch on that fixed assignment "
            "(in-memory trainer only)",
            "choices": ["step", "epoch_start"],
        },
    )
    lambda_inter: float = field(default=0.1, metadata={"help": "weight of the patch-token OT loss"})
    lambda_intra: float = field(default=0.1, metadata={"help": "weight of the view-view OT losses"})
    intra_subset: int = field(
        default=16,
        metadata={
            "help": "global samples per step given a second view for "
            "the intra OT loss [ours: bounds its cost]"
        },
    )
    fused_ot_losses: bool = field(
        default=True,
        metadata={
            "help": "[ours, speed] solve the inter and intra OT loss problems in one padded solver call, "
            "matched captions cut to their used width (equal to separate solves up to float rounding: each "
            "problem stops on its own); false = one call per term on full-width matched captions (the old path)"
        },
    )
    reuse_own_text: bool = field(
        default=True,
        metadata={
            "help": "[ours, speed] on non-matching epochs the intra text term reuses the own captions' "
            "features of the CLIP term instead of encoding the same rows again (same values); on matching "
            "epochs the pool reuses the intra term's own-caption rows (detached) instead of encoding them again "
            "without gradient (same values up to rounding); false = the old extra forwards"
        },
    )
    fused_encoders: bool = field(
        default=True,
        metadata={
            "help": "[ours, speed] encode the intra term's second views in the same forward pass as the first "
            "views (per-row encoders: equal to separate passes up to float rounding); false = separate passes"
        },
    )
    ot: OTConfig = field(default_factory=OTConfig)
    safeclip_unimodal_epochs: int = field(
        default=2, metadata={"help": "SafeCLIP unimodal warm-up (paper: 5)"}
    )
    safeclip_clip_lr_scale: float = field(
        default=0.01, metadata={"help": "lr scale of the one CLIP-on-all epoch (paper: 5e-6 vs 5e-4)"}
    )
    safeclip_first_p: float = field(default=0.9, metadata={"help": "first split: p(clean) threshold"})
    safeclip_ratio_start: float = field(
        default=0.5, metadata={"help": "later splits: initial safe share [ours]"}
    )
    safeclip_ratio_step: float = field(
        default=0.05,
        metadata={"help": "safe share growth per epoch (paper 0.01 over 32 epochs; ours scaled)"},
    )
    safeclip_ratio_max: float = field(default=0.85, metadata={"help": "safe share cap (paper: 0.85)"})
    unimodal_temperature: float = field(default=0.1, metadata={"help": "in-modality InfoNCE temperature"})
    cleanclip_start_epoch: int = field(
        default=6,
        metadata={
            "help": "[ours] CleanCLIP fine-tunes a (poisoned) CLIP: epochs before this one are plain CLIP "
            "pre-training, the rest use the CleanCLIP objective, on data.clean_finetune_pairs clean pairs when "
            "> 0, else on the same poisoned data"
        },
    )
    cleanclip_inmodal_weight: float = field(
        default=1.0, metadata={"help": "CleanCLIP weight of the in-modality loss (its inmodal_weight option)"}
    )
    cleanclip_clip_weight: float = field(
        default=1.0,
        metadata={"help": "CleanCLIP weight of the cross-modal CLIP loss (its clip_weight option)"},
    )
    cleanclip_lr_scale: float = field(
        default=1.0,
        metadata={
            "help": "[ours] learning-rate multiplier of CleanCLIP's fine-tuning epochs (they continue the "
            "pre-training schedule; CleanCLIP itself fine-tunes with a fresh one)",
            "gt": 0,
        },
    )


@dataclass
class Batch:
    """One step's inputs, prepared by the trainer.

    ``idx (batch,)`` global dataset indices of the whole global batch (same on every rank); ``rows`` this
    rank's slice of it and ``loc = idx[rows]``. ``view1/view2 (local, C, H, W)`` two augmented views;
    ``ids1/mask1`` and ``ids2/mask2 (local, pos)`` two word-dropout views of the own captions.
    """

    idx: torch.Tensor
    rows: slice
    loc: torch.Tensor
    view1: torch.Tensor
    view2: torch.Tensor
    ids1: torch.Tensor
    mask1: torch.Tensor
    ids2: torch.Tensor
    mask2: torch.Tensor
    epoch: int
    step: int
    phase: str


@dataclass
class Assignment:
    """The captions a re-matching defense assigned to this rank's images (each ``(local, ...)``).

    ``index`` into the pool the defense searched; ``ids`` the assigned captions' token ids (for examples);
    ``sig``/``poison`` their content signature and poison flag (provenance, for diagnostics only).
    ``ot_marginal_error``/``ot_converged`` ``(local * k,)``: the matching OT solves' diagnostics, if any.
    """

    index: torch.Tensor
    ids: torch.Tensor
    sig: torch.Tensor
    poison: torch.Tensor
    ot_marginal_error: torch.Tensor | None = None
    ot_converged: torch.Tensor | None = None


@dataclass
class StepOutput:
    """``loss`` to backpropagate; ``terms`` its named parts (detached, logged as epoch means as
    ``loss_<name>``); ``assignment`` when captions were re-assigned this step."""

    loss: torch.Tensor
    terms: dict[str, float] = field(default_factory=dict)
    assignment: Assignment | None = None


class Defense:
    """Base class: plain CLIP every epoch (which is exactly the ``none`` defense).

    Class attributes: ``name`` (the config string), ``uses_bank`` (the trainer keeps the FIFO caption bank
    filled with every batch's captions), ``match_phases`` (phases whose steps return an assignment).
    """

    name: ClassVar[str] = ""
    uses_bank: ClassVar[bool] = False
    match_phases: ClassVar[tuple[str, ...]] = ()
    clean_phases: ClassVar[tuple[str, ...]] = ()  # phases that train on the trainer's clean set (CleanCLIP)

    def __init__(self, cfg: DefenseConfig):
        self.cfg = cfg

    # ---------------------------------------------------------------- per epoch
    def phase(self, epoch: int) -> str:
        """The phase name of ``epoch`` (logged; picks the step's behaviour)."""
        return "clip"

    def lr_scale(self, phase: str) -> float:
        """Multiplier on the scheduled learning rate during ``phase``."""
        return 1.0

    def start_epoch(self, tr: Trainer, epoch: int, phase: str) -> dict:
        """Work done once before an epoch's steps (e.g. a data split); returns stats to log."""
        return {}

    def is_match_epoch(self, epoch: int) -> bool:
        """Matching epochs: ``e >= rematch_warmup`` and ``(e - rematch_warmup) % rematch_every == 0``."""
        w, r = self.cfg.rematch_warmup, self.cfg.rematch_every
        return epoch >= w and (epoch - w) % r == 0

    # ---------------------------------------------------------------- per step
    def step(self, tr: Trainer, b: Batch) -> StepOutput:
        """The loss of one step; the trainer backpropagates and applies it."""
        return clip_step(tr, b)


def clip_step(tr: Trainer, b: Batch) -> StepOutput:
    """Plain symmetric InfoNCE on the own captions (first views); the batch enters the bank afterwards."""
    model = tr.model
    img, txt = model.encode_image(b.view1), model.encode_text(b.ids1, b.mask1)
    loss = clip_loss(all_gather_with_grad(img.global_), all_gather_with_grad(txt.global_), model.scale())
    tr.enqueue(b.ids1, b.mask1, txt, b.loc)
    return StepOutput(loss, {"clip": float(loss.detach())})


REGISTRY: dict[str, type[Defense]] = {}


def register(cls: type[Defense]) -> type[Defense]:
    """Class decorator: make ``cls`` available as ``defense: <cls.name>``."""
    if not cls.name or cls.name in REGISTRY:
        raise ValueError(f"defense class {cls.__name__} needs a new, non-empty name; got {cls.name!r}")
    REGISTRY[cls.name] = cls
    return cls
