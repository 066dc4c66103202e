"""OTCCLIP's option checks: settings that cannot act as written are refused with the keys that clash.

The recipe's preflight calls them through :meth:`~.base.Defense.check` before a run folder exists, so a run
that trains other defenses first stops at once; the defense calls them again when it is built (library
callers skip preflight).
"""

from __future__ import annotations

from reprlab.errors import ConfigError

# the options that act only through a flag, and their off values
_NEEDS_A_FLAG = {"flag_vouch": "all", "flag_cohort_start": -1, "trust_epoch": -1, "flagged_unlearn": 0.0}


def check_options(cfg) -> None:
    """Refuse OTCCLIP settings that cannot act as written (``cfg``: OTCCLIP's ``DefenseConfig``)."""
    if cfg.match_schedule == "epoch_start" and cfg.matched_text != "pool":
        raise ConfigError("defense.match_schedule=epoch_start supports matched_text=pool only")
    check_flag_options(cfg)


def check_flag_options(cfg) -> None:
    """Refuse flag settings that cannot act as written (``cfg``: OTCCLIP's ``DefenseConfig``), with the keys."""
    c = cfg
    if c.flag == "none":
        # flagged_train stays inert under flag='none' (the documented re-matching override sets it); these act
        # only through a flag, so setting one without it is a mistake worth naming
        unused = [k for k, off in _NEEDS_A_FLAG.items() if getattr(c, k) != off]
        if unused:
            names = ", ".join(f"defense.{k}" for k in unused)
            offs = " ".join(f"defense.{k}={_NEEDS_A_FLAG[k]}" for k in unused)
            raise ConfigError(
                f"{names} act only with a flag; set defense.flag=consensus, or turn them off: {offs}"
            )
        return
    if c.flag_until < c.flag_start:
        raise ConfigError(
            f"defense.flag_until ({c.flag_until}) must be >= defense.flag_start ({c.flag_start})"
        )
    if c.flag_release_until >= 0 and not 0 <= c.flag_release_epoch <= c.flag_release_until:
        raise ConfigError(
            f"defense.flag_release_until ({c.flag_release_until}) needs a release from an epoch at or before it: "
            f"defense.flag_release_epoch is {c.flag_release_epoch}; or set defense.flag_release_until=-1"
        )
    if c.flag_release_veto > 0 and c.flag_release_epoch < 0:
        raise ConfigError(
            "defense.flag_release_veto acts on a release: set defense.flag_release_epoch, or "
            "defense.flag_release_veto=0"
        )
    if c.flagged_unlearn > 0 and c.flagged_unlearn_rows == "held" and c.flag_cohort_start < 0:
        raise ConfigError(
            "defense.flagged_unlearn_rows=held needs a held cohort: set defense.flag_cohort_start"
        )
    for key, off in (("flag_cohort_purity", 0.0), ("flag_cohort_persist", 1), ("flag_cohort_grow", 0.0)):
        if getattr(c, key) != off and c.flag_cohort_start < 0:
            raise ConfigError(
                f"defense.{key} acts on a held cohort: set defense.flag_cohort_start, or turn it off: "
                f"defense.{key}={off}"
            )
