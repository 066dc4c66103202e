"""Which defense options need the whole training set in memory (a stream holds one window of it)."""

from __future__ import annotations

from reprlab.methods.otcclip.config.defense import DefenseConfig


def whole_set_options(cfg: DefenseConfig) -> list[str]:
    """The [ours] options (``key=value``) that key on training-pair indices, i.e. positions in the whole training
    set: ``match_schedule='epoch_start'`` re-matches every pair, ``own_negatives`` and ``reassigned_weight``
    compare the pair a caption came from with the image's own, ``flag`` scores every pair, ``copies_weight``
    counts copies over the whole set. A streaming trainer indexes its current window only, so these need the
    in-memory trainer (checked at preflight and by the defense)."""
    out = []
    if cfg.match_schedule == "epoch_start":
        out.append("defense.match_schedule=epoch_start")
    if cfg.own_negatives != "keep":
        out.append(f"defense.own_negatives={cfg.own_negatives}")
    if cfg.reassigned_weight != 1.0:
        out.append(f"defense.reassigned_weight={cfg.reassigned_weight:g}")
    if cfg.flag != "none":
        out.append(f"defense.flag={cfg.flag}")
    if cfg.copies_weight:
        out.append("defense.copies_weight=true")
    return out
