"""No defense: the plain CLIP loss (symmetric InfoNCE) on the own captions every epoch."""

from __future__ import annotations

from reprlab.methods.otcclip.defenses.base import Defense, register


@register
class NoDefense(Defense):
    name = "none"
