"""The defense interface: what a defense does to a batch's caption assignment, which losses it adds, what
it logs [ours: the structure; each defense's content cites its source in its own file].

A defense is a :class:`Defense` subclass in its own module of this package, decorated with
:func:`register`. The trainer (:mod:`..training.trainer`) owns everything the defenses share (data order,
augmentation noise, optimiser and schedule, the caption bank's storage, gradient sync) and hands itself to the
defense as a :class:`TrainerView`, the part of it a defense may read and call; it asks the defense, per epoch, for its phase, an optional epoch-start action (SafeCLIP's split) and a learning-rate
scale, and per step for a :class:`StepOutput`: the loss, its named terms (logged as epoch means) and, when
the defense re-assigned captions, an :class:`Assignment` (used for re-matching diagnostics and the
re-assigned-caption examples, never by the defense itself).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch
from torch import nn

from reprlab.methods.otcclip.config import DefenseConfig
from reprlab.methods.otcclip.defenses.losses import clip_loss
from reprlab.methods.otcclip.defenses.matching import CaptionBank
from reprlab.train.dist import all_gather_with_grad


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


class TrainerView(Protocol):
    """What a defense may read and call of the trainer that drives it (the trainers implement it; a defense
    never imports them).

    ``data`` is the training set the trainer holds now: the whole :class:`~..data.pairs.PairSet` in memory, or
    one window of a stream (``images uint8 (n, C, H, W)``, ``sig``, ``kind``); ``ids``/``mask (n, pos)`` its
    tokenized captions and ``poison bool (n,)`` its provenance (diagnostics only). ``state.safe bool (n,)`` is
    SafeCLIP's per-pair mask; ``bank`` the FIFO caption bank; ``in_memory`` whether ``data`` is the whole set.
    """

    model: nn.Module
    data: object
    ids: torch.Tensor
    mask: torch.Tensor
    poison: torch.Tensor
    state: nn.Module
    bank: CaptionBank
    seed: int
    device: torch.device
    in_memory: bool
    steps_per_epoch: int

    def enqueue(self, ids: torch.Tensor, mask: torch.Tensor, txt, loc: torch.Tensor) -> None:
        """Put the global batch's own captions into the bank (a no-op for defenses without one)."""

    def intra_rows(self, n_global: int) -> torch.Tensor:
        """This rank's local rows that get a second view for the intra-modality terms."""


class Defense:
    """Base class: plain CLIP every epoch (which is exactly the ``none`` defense).

    Class attributes: ``name`` (the config string), ``uses_bank`` (the trainer keeps the FIFO caption bank
    filled with every batch's captions), ``match_phases`` (phases whose steps return an assignment).
    """

    name: ClassVar[str] = ""
    uses_bank: ClassVar[bool] = False
    match_phases: ClassVar[tuple[str, ...]] = ()
    clean_phases: ClassVar[tuple[str, ...]] = ()  # phases that train on the trainer's clean set (CleanCLIP)
    # some phase's step leaves parameters without gradient (RoCLIP's matched text, SafeCLIP's unimodal
    # phase without the logit scale): DDP must then look for unused parameters every step
    partial_grad: ClassVar[bool] = False
    # trains on the pairs not marked as poisons only: a reference model, not a defense (the oracle)
    poison_free: ClassVar[bool] = False

    def __init__(self, cfg: DefenseConfig):
        self.cfg = cfg

    @staticmethod
    def check(cfg: DefenseConfig) -> None:
        """Refuse settings this defense cannot act on as written (``ConfigError`` naming the keys); the
        recipe's preflight calls it for every defense of a run before a run folder exists."""

    # ---------------------------------------------------------------- per epoch
    def phase(self, epoch: int) -> str:
        """The phase name of ``epoch`` (logged; picks the step's behaviour)."""
        return "clip"

    def lr_scale(self, phase: str) -> float:
        """Multiplier on the scheduled learning rate during ``phase``."""
        return 1.0

    def start_epoch(self, tr: TrainerView, epoch: int, phase: str) -> dict:
        """Work done once before an epoch's steps (e.g. a data split); returns stats to log."""
        return {}

    def is_match_epoch(self, epoch: int) -> bool:
        """Matching epochs: ``e >= rematch_warmup`` and ``(e - rematch_warmup) % rematch_every == 0``."""
        w, r = self.cfg.rematch_warmup, self.cfg.rematch_every
        return epoch >= w and (epoch - w) % r == 0

    # ---------------------------------------------------------------- per step
    def step(self, tr: TrainerView, b: Batch) -> StepOutput:
        """The loss of one step; the trainer backpropagates and applies it."""
        return clip_step(tr, b)


def clip_step(tr: TrainerView, b: Batch) -> StepOutput:
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
