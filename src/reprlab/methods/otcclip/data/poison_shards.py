"""Poisoning the user's own image-caption data: targeted poisons and a backdoor planted in a copy written as
webdataset shards, with a ``manifest.json`` of exactly what was planted [ours; the attacks follow RoCLIP
(targeted) and CleanCLIP (backdoor), as :mod:`.poison` does on our testbed].

Input: webdataset shards (a folder, one ``.tar``, or a brace pattern ``shard-{000000..000009}.tar``) or a
CSV/TSV/JSONL of (image path, caption). Two passes: the first reads keys and captions only (no image decoded)
and plans the poisons; the second copies every clean sample member by member, byte for byte (a shard sample's
members, or a table row's image file and caption), and writes the planted samples:

* targeted: each target image (given, or picked from an ImageFolder) is paired with N captions that name its
  adversarial class (the data's own captions, as RoCLIP; or CLIP's templates); the target file's bytes are the
  poison image and a copy goes to ``targets/`` for the evaluation. Poisons go at seeded random places of the
  stream (web shards do not hold them in a block).
* backdoor, one per trigger asked for (each with its own M pairs, disjoint): M clean pairs whose caption does not
  name the target class are fitted to ``image_size`` and triggered (:func:`..triggers.apply_trigger`, stored as
  PNG), captioned "a photo of a {target}"; they replace
  their clean pair or are added beside it.

Poisoned samples carry a ``.json`` member with ``kind`` (1 targeted, 2 backdoor), which the stream reads for
its re-matching diagnostics (never the defenses). ``manifest.json`` is :mod:`.shards`' manifest plus ``poison``:
the settings, the targets, each backdoor's trigger and seed, and ``planted``, one row (key, shard, kind, target,
and a backdoor's trigger) per poisoned sample.
"""

from __future__ import annotations

import json
import shutil
import tarfile
from dataclasses import asdict
from pathlib import Path

import numpy as np

from reprlab.errors import ConfigError, DataError
from reprlab.methods.otcclip.config import TRIGGERS, PoisonConfig
from reprlab.methods.otcclip.data import shard_reader as rd
from reprlab.methods.otcclip.data import shards as sh
from reprlab.methods.otcclip.data.folder import image_folder, load_image
from reprlab.methods.otcclip.data.mosaic import PROMPTS
from reprlab.methods.otcclip.data.pairs import BACKDOOR, TARGETED
from reprlab.methods.otcclip.data.poison import mentions
from reprlab.methods.otcclip.data.poison_io import ShardWriter, open_input
from reprlab.methods.otcclip.data.sources import TableSource
from reprlab.methods.otcclip.data.templates import CLIP_IMAGENET_TEMPLATES
from reprlab.methods.otcclip.data.triggers import apply_trigger
from reprlab.train.progress import progress

KIND_NAMES = {TARGETED: "targeted", BACKDOOR: "backdoor"}


def _shard_samples(paths: list[Path]):
    """``(key, parts or None, caption)`` of every sample of the shards; an unreadable shard is an error."""
    for path in paths:
        try:
            for sample in rd.iter_shard(path, on_bad="error"):  # webdataset's keys; a bad shard stops here
                key, parts = sample["__key__"], rd.parts(sample)
                try:
                    image, caption, _ = rd.split_sample(sample)
                except ValueError:  # UnicodeDecodeError too: copied as is, never a poison's source
                    image = caption = None
                caption = caption if image is not None else None  # no image: copied, never poisoned
                yield key, parts, caption
        except (OSError, EOFError, ValueError, tarfile.TarError) as err:  # ValueError: a header's octal field
            raise DataError(f"{path}: unreadable shard, not a tar archive or truncated ({err})") from None


def _table_samples(table: TableSource, skipped: dict, read: bool):
    """``(key, parts or None, caption)`` of the table's rows whose image exists (``parts`` read when ``read``);
    rows without an image file, or with an unsupported image type, are counted in ``skipped``."""
    from collections import Counter

    skip = Counter()
    for _, path, caption, meta in table.items(0, 1, 0, 0, False, skip):
        ext = path.suffix.lower().lstrip(".")
        if ext not in rd.IMAGE_MEMBERS:
            skip["unsupported_image_type"] += 1
            continue
        if not path.is_file():
            skip["missing_image"] += 1
            continue
        parts = {ext: path.read_bytes(), "txt": (caption or "").encode("utf-8")} if read else None
        yield f"{meta['index']:09d}", parts, caption
    skipped.update(skip)


def _samples(src, skipped: dict, read: bool = True):
    if isinstance(src, TableSource):
        return _table_samples(src, skipped, read)
    return _shard_samples(src)


def _pick_targets(cfg: PoisonConfig, rng: np.random.Generator) -> tuple[list[dict], tuple[str, ...]]:
    """The targets ``{source, true_class, target_class}`` and the class names known from ``targets_from``."""
    if cfg.targets and cfg.targets_from:
        raise ConfigError("give targets (image files) or targets_from (an ImageFolder), not both")
    if cfg.targets:
        if not cfg.adv_class:
            raise ConfigError("targets given as files need adv_class: the class their poison captions name")
        bad = [t for t in cfg.targets if Path(t).suffix.lower().lstrip(".") not in rd.IMAGE_MEMBERS]
        if bad:
            raise ConfigError(
                f"target {bad[0]} is not a {'/'.join(rd.IMAGE_MEMBERS)} file (a shard image member)"
            )
        return [
            {"source": str(p), "true_class": None, "target_class": cfg.adv_class} for p in cfg.targets
        ], ()
    if not cfg.targets_from or not cfg.n_targets:
        return [], ()
    folder = image_folder(cfg.targets_from, cfg.class_names, key="targets_from")
    names = folder.class_names
    if not cfg.adv_class and len(names) < 2:
        raise ConfigError(
            f"targets_from {folder.root} has one class: give adv_class, the class to mislabel it as"
        )
    ok = np.flatnonzero([names[y] != cfg.adv_class for y in folder.labels])
    if cfg.n_targets > len(ok):
        raise ConfigError(f"n_targets={cfg.n_targets} but {folder.root} has {len(ok)} eligible images")
    out = []
    for i in sorted(rng.choice(ok, cfg.n_targets, replace=False).tolist()):
        true = names[folder.labels[i]]
        adv = cfg.adv_class or names[(folder.labels[i] + rng.integers(1, len(names))) % len(names)]
        out.append({"source": str(folder.paths[i]), "true_class": true, "target_class": adv})
    return out, names


def _counts(cfg: PoisonConfig, n_clean: int, n_targets: int) -> tuple[int, int]:
    """(captions per target, backdoored pairs) from the counts or the rates."""
    if cfg.captions_per_target and cfg.targeted_rate:
        raise ConfigError("give captions_per_target or targeted_rate, not both")
    if cfg.backdoor and cfg.backdoor_rate:
        raise ConfigError("give backdoor or backdoor_rate, not both")
    per = cfg.captions_per_target
    if cfg.targeted_rate and n_targets:
        per = max(1, round(cfg.targeted_rate * n_clean / n_targets))
    m = cfg.backdoor or (round(cfg.backdoor_rate * n_clean) if cfg.backdoor_rate else 0)
    return per, m


def trigger_settings(cfg: PoisonConfig, seed: int, kind: str, k: int = 0) -> dict:
    """The ``k``-th backdoor's trigger as :func:`..triggers.apply_trigger` takes it (recorded in the manifest for the
    evaluation)."""
    s = cfg.image_size
    return {
        "kind": kind,
        "seed": seed + 2 + k,  # the first as the testbed's trigger seed
        "image_size": s,
        "patch": cfg.trigger_patch or max(1, round(s * 16 / 224)),
        "alpha": cfg.blend_alpha,
        "params": {
            "sig_amplitude": cfg.sig_amplitude,
            "sig_frequency": cfg.sig_frequency,
            "wanet_grid": cfg.wanet_grid,
            "wanet_strength": cfg.wanet_strength or 3.0 * s / 56,
        },
    }


def triggered_png(image: bytes | Path, trig: dict, channels: int | None = None, name: str = "") -> bytes:
    """An image fitted to the trigger's size, triggered, as PNG bytes (greyscale stays greyscale)."""
    if channels is None:
        from reprlab.io.untrusted import open_image_bounded

        channels = 1 if open_image_bounded(image, name=name or None).mode in ("L", "1", "I", "I;16") else 3
    x = load_image(image, trig["image_size"], channels, name=name or None)[None]
    x = apply_trigger(x, trig["kind"], trig["seed"], trig["patch"], trig["alpha"], **trig["params"])
    return sh._png(x[0])


def poison_dataset(
    source: str | Path, out: str | Path, cfg: PoisonConfig, seed: int = 0, image_root: str | Path = ""
) -> dict:
    """Write a poisoned copy of ``source`` as shards in ``out`` (module docstring); returns the manifest.

    Raises:
        ConfigError: options that cannot work (naming them). DataError: an unreadable input (naming the file),
        too few captions naming an adversarial class, too few pairs to backdoor.
    """
    out = Path(out)
    if out.is_file():
        raise ConfigError(f"{out} is a file; give an empty or new folder for the poisoned shards")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held:
        # any file, not only shards: a data folder given as OUT would get shards and targets/ mixed into it
        shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        raise ConfigError(f"{out} is not empty (it holds {shown}); give an empty or new folder")
    src = open_input(source, image_root)
    rng = np.random.default_rng([seed, 9001])
    targets, class_names = _pick_targets(cfg, rng)
    kinds = tuple(cfg.trigger)
    if (cfg.backdoor or cfg.backdoor_rate) and not cfg.backdoor_target:
        raise ConfigError("backdoor needs backdoor_target: the class its captions name")
    if not kinds or len(set(kinds)) < len(kinds) or any(t not in TRIGGERS for t in kinds):
        raise ConfigError(f"trigger: one or more of {list(TRIGGERS)}, each once; got {list(kinds)}")
    skipped: dict = {}
    keys, captions = [], []
    for key, _, caption in progress(_samples(src, skipped, read=False), desc="poison: scan"):
        keys.append(key)
        captions.append(caption)
    if not keys:
        raise DataError(f"{source}: no sample to poison (skipped: {dict(skipped) or 'none'})")
    valid = np.asarray([c is not None and c.strip() != "" for c in captions])
    per, m = _counts(cfg, int(valid.sum()), len(targets))
    if targets and per < 1:
        raise ConfigError("targeted poisons need captions_per_target or targeted_rate > 0")
    # backdoor: clean pairs whose caption does not name the target (CleanCLIP draws at random) [ours: that rule]
    bd_of: dict[int, int] = {}  # input row -> which backdoor (trigger) it makes
    if m:
        ok = [i for i in np.flatnonzero(valid) if not _names(captions[i], cfg.backdoor_target)]
        if m * len(kinds) > len(ok):
            raise DataError(
                f"{source}: {m} backdoored pairs x {len(kinds)} triggers asked, {len(ok)} clean pairs do not name "
                "the target"
            )
        rows = rng.choice(ok, m * len(kinds), replace=False).tolist()
        bd_of = {int(r): j // m for j, r in enumerate(rows)}
    taken = set(bd_of) if cfg.backdoor_mode == "replace" else set()
    for t in targets:
        t["captions"] = _poison_captions(
            t["target_class"], per, captions, valid, taken, class_names, cfg, rng
        )
    n_in, n_targeted = len(keys), per * len(targets)
    n_out = n_in + n_targeted + (m * len(kinds) if cfg.backdoor_mode == "add" else 0)
    at = np.sort(rng.integers(0, n_in + 1, n_targeted))  # a poison goes before input sample at[j]
    queue = [(t, j) for t in range(len(targets)) for j in range(per)]
    queue = [queue[i] for i in rng.permutation(len(queue))]
    used = set(keys)
    for tg in targets:  # readable, or an error naming it, before any folder or file is made
        load_image(Path(tg["source"]), 8, 3)
    out.mkdir(parents=True, exist_ok=True)
    (out / "targets").mkdir(exist_ok=True)
    for t, tg in enumerate(targets):
        tg["image"] = f"targets/target-{t:03d}{Path(tg['source']).suffix.lower()}"
        shutil.copyfile(tg["source"], out / tg["image"])
        tg["keys"] = []
    bds = [{"trigger": trigger_settings(cfg, seed, kind, k), "target_class": cfg.backdoor_target,
             "mode": cfg.backdoor_mode, "keys": [], "source_keys": [], "unreadable": []}
           for k, kind in enumerate(kinds)] if m else []  # fmt: skip
    writer = ShardWriter(out, n_out, cfg.shard_size, cfg.n_shards)
    planted: list[dict] = []
    q = 0

    def plant(key: str, parts: dict, kind: int, target: str, trigger: str = "") -> None:
        if key in used:
            raise DataError(
                f"{source}: a sample key {key!r} is already in the data; poisoned keys must be new"
            )
        used.add(key)
        meta = {"kind": kind, "index": -1, "target": target}
        shard = writer.add(key, {**parts, "json": json.dumps(meta, sort_keys=True).encode()})
        planted.append({"key": key, "shard": shard, "kind": KIND_NAMES[kind], "target": target})
        if trigger:
            planted[-1]["trigger"] = trigger

    def targeted_before(i: int) -> None:
        nonlocal q
        while q < len(at) and at[q] <= i:
            t, j = queue[q]
            tg = targets[t]
            ext = Path(tg["image"]).suffix.lstrip(".")
            parts = {ext: (out / tg["image"]).read_bytes(), "txt": tg["captions"][j].encode()}
            plant(f"poison-t{t:03d}-{j:05d}", parts, TARGETED, tg["target_class"])
            tg["keys"].append(planted[-1]["key"])
            q += 1

    for i, (key, parts, _) in enumerate(progress(_samples(src, {}, read=True), total=n_in, desc="poison")):
        targeted_before(i)
        if i in bd_of:
            bd = bds[bd_of[i]]
            img = next((parts[e] for e in rd.IMAGE_MEMBERS if e in parts), None)
            try:
                png = triggered_png(img, bd["trigger"], name=f"sample {key} of {source}")
            except (DataError, TypeError):  # an unreadable image: the pair stays clean, copied as is
                bd["unreadable"].append(key)
                png = None
            if png is not None:
                if cfg.backdoor_mode == "add":
                    writer.add(key, parts)
                cap = PROMPTS[int(rng.integers(len(PROMPTS)))].format(cfg.backdoor_target)
                plant(f"poison-b{bd_of[i]}-{len(bd['keys']):07d}", {"png": png, "txt": cap.encode()}, BACKDOOR,
                      cfg.backdoor_target, bd["trigger"]["kind"])  # fmt: skip
                bd["keys"].append(planted[-1]["key"])
                bd["source_keys"].append(key)
                continue
        writer.add(key, parts)
    targeted_before(n_in)
    shards = writer.close()
    return _write_manifest(out, source, cfg, seed, shards, writer.count, n_in, skipped, targets, bds, planted)


def _names(caption: str, cls: str) -> bool:
    """:func:`..poison.mentions`, after a cheap substring test (most captions of a web corpus name neither)."""
    return cls.lower() in caption.lower() and mentions(caption, cls)


def _poison_captions(cls, per, captions, valid, taken, class_names, cfg, rng) -> list[str]:
    """``per`` captions naming ``cls``: the corpus's (fewest other class names first, random among equals), or
    CLIP's templates."""
    if cfg.caption_source == "templates":
        return [CLIP_IMAGENET_TEMPLATES[int(i)].format(cls) for i in rng.integers(80, size=per)]
    pool = [i for i in np.flatnonzero(valid) if i not in taken and _names(captions[i], cls)]
    if len(pool) < per:
        raise DataError(
            f"only {len(pool)} captions of the data name {cls!r}; {per} poison captions per target asked",
            hint="lower captions_per_target / targeted_rate, or take caption_source 'templates'",
        )
    pool = [pool[i] for i in rng.permutation(len(pool))]
    pool.sort(key=lambda i: sum(mentions(captions[i], c) for c in class_names))
    return [captions[i] for i in pool[:per]]


def _write_manifest(out, source, cfg, seed, shards, n_samples, n_in, skipped, targets, bds, planted) -> dict:
    """:mod:`.shards`' manifest (shards, counts) plus the ``poison`` record; written last, atomically."""
    manifest = {
        "n_samples": n_samples,
        "n_poisoned": len(planted),
        "shard_size": cfg.shard_size,
        "shards": [p.name for p in shards],
        "poison": {
            "source": str(source),
            "seed": seed,
            "config": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items()},
            "n_input": n_in,
            "skipped": dict(skipped),
            "targeted": targets,
            "backdoors": bds,
            "planted": planted,
        },
    }
    tmp = out / (sh.MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    tmp.replace(out / sh.MANIFEST)
    return manifest
