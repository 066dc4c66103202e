"""``HookPoint``: an identity module that names one activation so hooks can read or replace it.

The TransformerLens idea in a few lines (our own implementation): every activation worth studying passes
through ``HookPoint.forward``; a forward hook registered on that module sees the tensor and may return a
replacement. Module names (``blocks.0.hook_resid_post``) are the stable, string-addressed hook names.
"""

from __future__ import annotations

from torch import Tensor, nn


class HookPoint(nn.Module):
    """Identity ``x -> x``; exists only so that forward hooks have a named place to attach."""

    def forward(self, x: Tensor) -> Tensor:
        return x
