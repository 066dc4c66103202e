"""Our offline testbed [ours]: the poisoned training pairs and the held-out evaluation sets of one seed.

No captioned images exist offline, so the training pairs are mosaics (:mod:`.mosaic`) of Fashion-MNIST items (or
generated shapes, :mod:`.shapes`), poisoned with targeted poisons and a backdoor (:mod:`.poison`) at rates far
above web scale because the dataset is tiny: the undefended model must be attacked, or no defense can be judged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reprlab.assets import FASHION_MNIST_CLASSES, fashion_mnist
from reprlab.methods.otcclip.config import DataConfig
from reprlab.methods.otcclip.data.mosaic import make_mosaics, make_single_items
from reprlab.methods.otcclip.data.pairs import BACKDOOR, TARGETED, LabeledSet, PairSet, SignatureIndex
from reprlab.methods.otcclip.data.poison import TargetSet, add_backdoor, add_targeted, add_wanet_noise
from reprlab.methods.otcclip.data.shapes import SHAPES, make_shape_items
from reprlab.methods.otcclip.data.web import make_web_pairs, web_single_items

# Fashion-MNIST index ranges [ours]: mosaics draw from train[:50000], the linear probe trains on
# train[50000:], evaluation uses test[:5000] and targets come from test[5000:], so no target image is
# ever trained on (except as a poison) or evaluated as a clean item.
MOSAIC_ITEMS, PROBE_ITEMS, EVAL_ITEMS, TARGET_ITEMS = (
    slice(0, 50000),
    slice(50000, 60000),
    slice(0, 5000),
    slice(5000, 10000),
)


@dataclass
class Testbed:
    pairs: PairSet
    targets: TargetSet
    eval_set: LabeledSet
    probe_train: LabeledSet
    backdoor_class: int
    clean: PairSet | None = None  # CleanCLIP's clean fine-tuning set (data.clean_finetune_pairs)
    wanet_noise_rows: torch.Tensor | None = None  # WaNet noise-mode rows of ``pairs``
    noisy_rows: torch.Tensor | None = None  # fashion_web: rows of ``pairs`` whose caption is alt-text noise
    caption_noise: dict | None = None  # fashion_web: counts of generic and wrong-class captions


def trigger_params(cfg: DataConfig) -> dict:
    """The trigger's settings from the data config, as keyword arguments of ``apply_trigger``."""
    return {
        "patch": cfg.trigger_patch,
        "sig_amplitude": cfg.sig_amplitude,
        "sig_frequency": cfg.sig_frequency,
        "wanet_grid": cfg.wanet_grid,
        "wanet_strength": cfg.wanet_strength,
    }


def build_testbed(cfg: DataConfig, seed: int) -> Testbed:
    """The poisoned training set and the evaluation sets, deterministic from ``seed``."""
    if cfg.testbed in ("fashion_mnist", "fashion_web"):
        names = FASHION_MNIST_CLASSES
        x, y = fashion_mnist("train")
        xt, yt = fashion_mnist("test")
    elif cfg.testbed == "shapes":
        names = SHAPES
        x, y = make_shape_items(60000, seed + 10)
        xt, yt = make_shape_items(10000, seed + 11)
    else:
        raise ValueError(
            f"unknown testbed {cfg.testbed!r}; choose 'fashion_web', 'fashion_mnist' or 'shapes'"
        )
    if cfg.backdoor_target not in names:
        raise ValueError(f"backdoor_target {cfg.backdoor_target!r} is not one of {names}")
    if not 1 <= cfg.n_eval <= 5000:
        raise ValueError(f"n_eval must be in [1, 5000], got {cfg.n_eval}")
    sigs = SignatureIndex()
    web = cfg.testbed == "fashion_web"
    noisy_rows = noise_counts = None

    def web_pairs(n: int, web_seed: int):
        return make_web_pairs(
            n,
            web_seed,
            (x[MOSAIC_ITEMS], y[MOSAIC_ITEMS]),
            cfg.caption_noise,
            cfg.caption_noise_wrong,
            signatures=sigs,
            class_names=names,
        )

    def mosaics(n: int, mosaic_seed: int) -> PairSet:
        if web:
            return web_pairs(n, mosaic_seed).pairs
        return make_mosaics(
            n,
            mosaic_seed,
            cfg.min_items,
            cfg.max_items,
            cfg.tint,
            source=(x[MOSAIC_ITEMS], y[MOSAIC_ITEMS]),
            signatures=sigs,
            class_names=names,
        )

    if web:
        made = web_pairs(cfg.n_pairs, seed)
        pairs, noisy_rows = made.pairs, made.noisy
        noise_counts = {"generic": made.n_generic, "wrong": made.n_wrong}
    else:
        pairs = mosaics(cfg.n_pairs, seed)
    pairs, targets = add_targeted(
        pairs,
        xt[TARGET_ITEMS],
        yt[TARGET_ITEMS],
        cfg.n_targets,
        cfg.captions_per_target,
        seed + 1,
        cfg.tint,
        render=web_single_items if web else None,
    )
    backdoor_class = names.index(cfg.backdoor_target)
    pairs = add_backdoor(
        pairs, cfg.backdoor_pairs, backdoor_class, cfg.trigger, seed + 2, sigs, **trigger_params(cfg)
    )
    noise_rows = None
    if cfg.wanet_noise_ratio > 0:
        if cfg.trigger != "wanet":
            raise ValueError(f"data.wanet_noise_ratio needs data.trigger=wanet, not {cfg.trigger!r}")
        pairs, noise_rows = add_wanet_noise(
            pairs,
            round(cfg.wanet_noise_ratio * cfg.backdoor_pairs),
            seed + 6,
            seed + 2,  # the backdoor's trigger seed
            cfg.wanet_grid,
            cfg.wanet_strength,
            cfg.wanet_noise_px,
        )
    clean = None
    if cfg.clean_finetune_pairs > 0:
        # [ours] new scenes (seed + 5) from the same item pool as the training mosaics: a clean sample of the
        # training distribution, never poisoned (poisons are built above, on the training pairs only)
        clean = mosaics(cfg.clean_finetune_pairs, seed + 5)
    xe, ye = xt[EVAL_ITEMS][: cfg.n_eval], yt[EVAL_ITEMS][: cfg.n_eval]
    xp, yp = x[PROBE_ITEMS][: cfg.n_probe_train], y[PROBE_ITEMS][: cfg.n_probe_train]
    if web:
        eval_set, probe = web_single_items(xe, ye, seed + 3), web_single_items(xp, yp, seed + 4)
    else:
        eval_set, probe = (
            make_single_items(xe, ye, seed + 3, cfg.tint),
            make_single_items(xp, yp, seed + 4, cfg.tint),
        )
    return Testbed(
        pairs, targets, eval_set, probe, backdoor_class, clean, noise_rows, noisy_rows, noise_counts
    )


def testbed_info(cfg: DataConfig, bed: Testbed, kinds: torch.Tensor | None) -> dict:
    """The report's data fields for the testbed (poison counts only when the stream is the testbed itself)."""
    out = {
        "n_eval": len(bed.eval_set.labels),
        "targets": [
            {"true": bed.pairs.class_names[int(t)], "target": bed.pairs.class_names[int(g)]}
            for t, g in zip(bed.targets.true, bed.targets.target)
        ],
        "backdoor_target": cfg.backdoor_target,
        "trigger": cfg.trigger,
    }
    if bed.clean is not None:
        out["n_clean_finetune"] = len(bed.clean)
    if bed.wanet_noise_rows is not None:
        out["n_wanet_noise"] = len(bed.wanet_noise_rows)
    if bed.caption_noise is not None:
        out["n_caption_noise_generic"] = bed.caption_noise["generic"]
        out["n_caption_noise_wrong"] = bed.caption_noise["wrong"]
    if kinds is not None:
        out.update(
            n_clean=int((kinds == 0).sum()),
            n_targeted=int((kinds == TARGETED).sum()),
            n_backdoor=int((kinds == BACKDOOR).sum()),
            poison_rate=float((kinds != 0).float().mean()),
            caption_examples=bed.pairs.captions[:5],
        )
    return out
