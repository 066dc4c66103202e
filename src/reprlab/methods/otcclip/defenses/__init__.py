"""Defenses as classes: one module per defense, each registering a :class:`Defense` subclass.

Every module of this package is imported here, so a new defense is a new file with a ``@register``-ed
class; the trainer and the recipe look defenses up by name in :data:`REGISTRY`.

* ``base``: the interface (``Defense``, ``Batch``, ``StepOutput``, ``Assignment``, ``TrainerView``), the registry;
  the knobs every defense reads are ``DefenseConfig`` (:mod:`..config.defense`).
* ``losses``: CLIP InfoNCE, in-modality InfoNCE, the OT alignment losses; ``matching``: the caption bank, OTCCLIP's
  OT re-matching and RoCLIP's nearest-neighbour matching.
* ``none``, ``roclip``, ``safeclip``, ``cleanclip``, ``otcclip``: one defense each; ``copies``, ``consensus``,
  ``release``, ``blend`` and ``options`` (its option checks) OTCCLIP's parts; ``oracle``: the poison-free
  reference model (trains on the pairs not marked as poisons).
"""

from __future__ import annotations

import importlib
import pkgutil

from reprlab.errors import ConfigError
from reprlab.methods.otcclip.config import DEFAULT_DEFENSES, DefenseConfig
from reprlab.methods.otcclip.defenses.base import (
    REGISTRY,
    Assignment,
    Batch,
    Defense,
    StepOutput,
    TrainerView,
    clip_step,
    register,
)

# every module of the package (importing a shared part such as ``losses`` registers nothing)
for _mod in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if _mod != "base":
        importlib.import_module(f"{__name__}.{_mod}")


def make_defense(name: str, cfg: DefenseConfig) -> Defense:
    """The defense registered as ``name``, configured by ``cfg``."""
    if name not in REGISTRY:
        raise ConfigError(f"unknown defense {name!r}; choose one of {tuple(REGISTRY)}")
    return REGISTRY[name](cfg)


__all__ = [
    "DEFAULT_DEFENSES",
    "REGISTRY",
    "Assignment",
    "Batch",
    "Defense",
    "DefenseConfig",
    "StepOutput",
    "TrainerView",
    "clip_step",
    "make_defense",
    "register",
]
