"""Named hook points, activation cache and patching context managers (shared by interp code).

See :mod:`reprlab.hooks.sites` for the hook-name vocabulary and :mod:`reprlab.hooks.context` for usage.
"""

from reprlab.hooks.context import Cache, hooks, patch, patch_positions, replace_with, run_with_cache
from reprlab.hooks.hook_point import HookPoint
from reprlab.hooks.sites import (
    Site,
    block_norms,
    final_norm_and_unembed,
    head_out_weight,
    is_hooked_gpt,
    n_heads,
    n_layers,
    resolve,
    unwrap,
)

__all__ = [
    "Cache", "HookPoint", "Site", "block_norms", "final_norm_and_unembed", "head_out_weight", "hooks",
    "is_hooked_gpt", "n_heads", "n_layers", "patch", "patch_positions", "replace_with", "resolve",
    "run_with_cache", "unwrap",
]  # fmt: skip
