"""``reprlab otcclip poison`` and the recipe's ``poison`` stage: the user's data poisoned into shards
(:mod:`..data.poison_shards`), summarised in a few counts."""

from __future__ import annotations

from pathlib import Path

from reprlab.methods.otcclip.config import PoisonConfig
from reprlab.methods.otcclip.data.poison_shards import poison_dataset


def poison_summary(manifest: dict) -> dict:
    """The counts a person checks after poisoning: samples in and out, poisons by kind, shards."""
    p = manifest["poison"]
    kinds = [r["kind"] for r in p["planted"]]
    out = {
        "n_input": p["n_input"],
        "n_samples": manifest["n_samples"],
        "n_targeted": kinds.count("targeted"),
        "n_targets": len(p["targeted"]),
        "n_backdoor": kinds.count("backdoor"),
        "n_shards": len(manifest["shards"]),
        **{f"skipped_{k}": v for k, v in sorted(p["skipped"].items())},
    }
    if p["backdoors"]:
        out["trigger"] = ", ".join(b["trigger"]["kind"] for b in p["backdoors"])
        out["backdoor_unreadable"] = sum(len(b["unreadable"]) for b in p["backdoors"])
    return out


def poison_command(source: str, out: Path, cfg: PoisonConfig, seed: int, image_root: str = "") -> dict:
    """Poison ``source`` into ``out``; returns :func:`poison_summary`."""
    return poison_summary(poison_dataset(source, out, cfg, seed, image_root))
