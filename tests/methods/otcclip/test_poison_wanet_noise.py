"""WaNet's noise mode (``data.wanet_noise_ratio``): clean pairs warped with the trigger field plus per-pixel
noise, keeping their true captions; never the exact trigger warp, never a backdoor pair; off by default."""

from dataclasses import replace

import pytest
import torch

from reprlab.methods.otcclip.data.mosaic import make_mosaics
from reprlab.methods.otcclip.data.pairs import BACKDOOR, CLEAN, SignatureIndex
from reprlab.methods.otcclip.data.poison import add_backdoor, add_wanet_noise
from reprlab.methods.otcclip.data.triggers import apply_trigger


def _poisoned(items, trigger="wanet", n=60):
    sigs = SignatureIndex()
    pairs = make_mosaics(n, seed=0, source=items, signatures=sigs)
    return add_backdoor(pairs, 6, 8, trigger, seed=2, signatures=sigs, wanet_strength=3.0)


def test_noise_mode_pairs_keep_their_true_captions_and_get_a_noised_trigger_warp(items):
    before = _poisoned(items)
    after, rows = add_wanet_noise(before, 12, seed=6, trigger_seed=2, wanet_strength=3.0, noise_px=0.5)
    assert len(rows) == 12 and len(set(rows.tolist())) == 12
    # clean pairs only, captions / provenance untouched, every other row bit-identical
    assert bool((before.kind[rows] == CLEAN).all()) and not bool((before.kind[rows] == BACKDOOR).any())
    assert after.captions == before.captions
    assert torch.equal(after.kind, before.kind) and torch.equal(after.sig, before.sig)
    others = torch.ones(len(before), dtype=torch.bool)
    others[rows] = False
    assert torch.equal(after.images[others], before.images[others])
    orig = before.images[rows]
    trig = apply_trigger(orig, "wanet", seed=2, wanet_strength=3.0)  # the exact trigger warp of these images
    noised = after.images[rows]
    diff_trigger = (noised.float() - trig.float()).abs().flatten(1)
    diff_orig = (noised.float() - orig.float()).abs().flatten(1)
    # warped (not the originals), near the trigger warp (noise of +-0.5 px), but never exactly the trigger warp
    assert bool((diff_orig.gt(2).float().mean(1) > 0.01).all())
    assert bool((diff_trigger.max(1).values > 0).all())
    assert float(diff_trigger.mean()) < 0.5 * float(diff_orig.mean())
    # each pair has its own noise, not one shared second trigger: every clean row given the same image, the
    # noised copies still differ from one another
    same = before.images.clone()
    same[before.kind == CLEAN] = before.images[rows[0]]
    twins, rows_t = add_wanet_noise(
        replace(before, images=same), 12, seed=6, trigger_seed=2, wanet_strength=3.0, noise_px=0.5
    )
    copies = twins.images[rows_t].flatten(1)
    assert len(torch.unique(copies, dim=0)) == len(rows_t)
    # deterministic in its seeds
    again, rows2 = add_wanet_noise(before, 12, seed=6, trigger_seed=2, wanet_strength=3.0, noise_px=0.5)
    assert torch.equal(rows, rows2) and torch.equal(again.images, after.images)


def test_noise_mode_in_the_testbed_is_off_by_default_and_wanet_only():
    from reprlab.methods.otcclip.config import DataConfig
    from reprlab.methods.otcclip.data.testbed import build_testbed

    small = dict(
        n_pairs=300, n_targets=1, captions_per_target=5, backdoor_pairs=10, n_eval=20, n_probe_train=20
    )
    base = build_testbed(DataConfig(trigger="wanet", **small), 0)
    assert base.wanet_noise_rows is None and base.clean is None
    noised = build_testbed(DataConfig(trigger="wanet", wanet_noise_ratio=2, **small), 0)
    rows = noised.wanet_noise_rows
    assert len(rows) == 20 and bool((noised.pairs.kind[rows] == CLEAN).all())
    assert noised.pairs.captions == base.pairs.captions
    changed = (noised.pairs.images != base.pairs.images).flatten(1).any(1)
    assert torch.equal(torch.nonzero(changed).flatten(), rows)
    with pytest.raises(ValueError, match="needs data.trigger=wanet"):
        build_testbed(DataConfig(trigger="badnets", wanet_noise_ratio=2, **small), 0)


def test_the_clean_finetuning_set_is_clean_new_and_leaves_the_training_pairs_alone():
    from reprlab.methods.otcclip.config import DataConfig
    from reprlab.methods.otcclip.data.testbed import build_testbed

    small = dict(
        n_pairs=300, n_targets=1, captions_per_target=5, backdoor_pairs=10, n_eval=20, n_probe_train=20
    )
    base = build_testbed(DataConfig(**small), 0)
    bed = build_testbed(DataConfig(clean_finetune_pairs=50, **small), 0)
    assert len(bed.clean) == 50 and bool((bed.clean.kind == CLEAN).all())
    assert torch.equal(bed.pairs.images, base.pairs.images) and bed.pairs.captions == base.pairs.captions
    assert torch.equal(bed.pairs.sig, base.pairs.sig)
    assert bed.clean.captions != base.pairs.captions[:50]  # other scenes (another seed)
