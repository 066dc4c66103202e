"""Defenses as classes: one module per defense, each registering a :class:`Defense` subclass.

Every module of this package is imported here, so a new defense is a new file with a ``@register``-ed
class; the trainer and the recipe look defenses up by name in :data:`REGISTRY`.
"""

from __future__ import annotations

import importlib
import pkgutil

from reprlab.methods.otcclip.defenses.base import (
    REGISTRY,
    Assignment,
    Batch,
    Defense,
    DefenseConfig,
    StepOutput,
    clip_step,
    register,
)

for _mod in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if _mod != "base":
        importlib.import_module(f"{__name__}.{_mod}")

# the defenses a recipe trains by default, in this order (CleanCLIP and later additions are opt-in)
DEFAULT_DEFENSES = ("none", "roclip", "safeclip", "otcclip")


def make_defense(name: str, cfg: DefenseConfig) -> Defense:
    """The defense registered as ``name``, configured by ``cfg``."""
    from reprlab.errors import ConfigError

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
    "clip_step",
    "make_defense",
    "register",
]
