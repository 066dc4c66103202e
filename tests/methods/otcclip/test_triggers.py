"""Backdoor triggers (SIG, WaNet, random-position BadNets next to corner BadNets and blended): each is a
deterministic function of its seed, matches its formula on inputs whose answer is known, and is never a
no-op; the ASR evaluation applies exactly the trigger that was trained on."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from reprlab.methods.otcclip.data.mosaic import class_prompts, make_mosaics
from reprlab.methods.otcclip.data.pairs import BACKDOOR, LabeledSet, SignatureIndex
from reprlab.methods.otcclip.data.poison import add_backdoor
from reprlab.methods.otcclip.data.tokenizer import WordTokenizer
from reprlab.methods.otcclip.data.triggers import (
    TRIGGERS,
    apply_trigger,
    patch_positions,
    trigger_pattern,
    wanet_field,
)
from reprlab.methods.otcclip.evaluation import metrics as ev
from reprlab.methods.otcclip.models.features import ImageFeatures

from .otcclip_oracle import CLASSES, OracleCLIP


def _grey(n=4, value=100, size=56):
    return torch.full((n, 1, size, size), value, dtype=torch.uint8)


def _textured(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(30, 220, (n, 1, 56, 56), generator=g, dtype=torch.uint8)


@pytest.mark.parametrize("kind", TRIGGERS)
def test_every_trigger_is_deterministic_and_changes_the_image(kind):
    x = _textured()
    a, b = apply_trigger(x, kind, seed=3), apply_trigger(x, kind, seed=3)
    assert torch.equal(a, b) and a.shape == x.shape and a.dtype == torch.uint8
    # not a no-op: a sizeable share of the pixels of every image changes
    changed = (a.int() - x.int()).abs().gt(2).float().mean((1, 2, 3))
    assert bool((changed > 0.015).all()), changed  # the smallest, an 8x8 patch, is 2% of 56x56
    if kind != "sig":  # SIG is a fixed signal with no randomness; every other trigger depends on the seed
        assert not torch.equal(a, apply_trigger(x, kind, seed=4))
    else:
        assert torch.equal(a, apply_trigger(x, kind, seed=4))


def test_unknown_trigger_is_rejected():
    with pytest.raises(ValueError, match="trigger"):
        apply_trigger(_grey(), "bogus", seed=0)


def test_sig_amplitude_and_frequency():
    out = apply_trigger(_grey(2, value=100), "sig", seed=0).float() - 100  # grey 100: no clipping
    j = np.arange(56)
    expect = np.round(60 * np.sin(2 * np.pi * 6 * j / 56))  # Barni et al.'s formula, CleanCLIP's 60/255
    # same on every row; exact: rounded integers, each 60 sin(.) >= 4e-3 from a .5 boundary (float32: ~1e-4)
    assert np.array_equal(out[0, 0].numpy(), np.broadcast_to(expect, (56, 56)))
    spectrum = np.abs(np.fft.rfft(out[0, 0, 0].numpy()))
    assert int(spectrum.argmax()) == 6  # 6 periods across the width
    assert 58 <= float(out.max()) <= 60 and -60 <= float(out.min()) <= -58  # amplitude 60 (rounded)
    half = apply_trigger(_grey(1), "sig", seed=0, sig_amplitude=30.0, sig_frequency=3.0).float() - 100
    assert int(np.abs(np.fft.rfft(half[0, 0, 0].numpy())).argmax()) == 3 and float(half.max()) <= 30


def test_wanet_is_identity_at_strength_zero_and_bounded_and_smooth():
    x = _textured()
    assert torch.equal(apply_trigger(x, "wanet", seed=1, wanet_strength=0.0), x)
    field = wanet_field((56, 56), seed=1, grid=4, strength=3.0)
    assert field.shape == (2, 56, 56)
    assert float(field.abs().max()) == pytest.approx(3.0, abs=1e-5)  # the bound is reached, not exceeded
    # smooth (WaNet's point): neighbouring displacements differ by far less than a pixel
    assert float(field.diff(dim=1).abs().max()) < 0.6 and float(field.diff(dim=2).abs().max()) < 0.6
    assert torch.equal(field, wanet_field((56, 56), seed=1, grid=4, strength=3.0))
    assert not torch.equal(field, wanet_field((56, 56), seed=2, grid=4, strength=3.0))


def test_wanet_moves_pixels_by_its_field():
    """On a linear ramp bilinear resampling is exact: out(y, x) = ramp(x + dx) where inside the image."""
    ramp = (4 * torch.arange(56)).to(torch.uint8)  # 0..220
    for axis in (0, 1):  # horizontal ramp checks dx, vertical ramp checks dy
        img = (ramp[None, :].expand(56, 56) if axis == 0 else ramp[:, None].expand(56, 56))[None, None]
        out = apply_trigger(img.contiguous(), "wanet", seed=5, wanet_strength=3.0).float()[0, 0]
        field = wanet_field((56, 56), seed=5, grid=4, strength=3.0)[axis]
        coord = torch.arange(56.0)[None, :] if axis == 0 else torch.arange(56.0)[:, None]
        moved = coord + field
        inside = (moved >= 0) & (moved <= 55)
        expect = 4 * moved.clamp(0, 55)  # border clamping outside
        assert float((out - expect).abs().max()) <= 0.5 + 1e-4  # uint8 rounding only
        assert inside.float().mean() > 0.8 and float(field.abs().max()) > 1


def test_random_position_badnets_lands_inside_at_different_places():
    n, patch = 40, 8
    x = _grey(n, value=100)  # the binary 0/255 patch differs from 100 at every one of its pixels
    out = apply_trigger(x, "badnets_random", seed=7, patch=patch)
    pos = patch_positions(n, (56, 56), seed=7, patch=patch)
    pattern = trigger_pattern("badnets_random", (1, 56, 56), seed=7, patch=patch)
    assert bool(((pos >= 0) & (pos <= 56 - patch)).all())
    assert len({tuple(p) for p in pos.tolist()}) > n // 2  # different places
    for i, (top, left) in enumerate(pos.tolist()):
        changed = torch.nonzero(out[i, 0] != 100)
        # exactly one full patch x patch square changed, at the drawn position (so fully inside the image)
        assert len(changed) == patch * patch
        assert changed.min(0).values.tolist() == [top, left]
        assert changed.max(0).values.tolist() == [top + patch - 1, left + patch - 1]
        assert torch.equal(out[i, :, top : top + patch, left : left + patch].float(), pattern)
    # the same pattern as the corner BadNets with the same seed: only the position differs
    assert torch.equal(pattern, trigger_pattern("badnets", (1, 56, 56), seed=7, patch=patch))


@pytest.mark.parametrize("kind", TRIGGERS)
def test_add_backdoor_triggers_exactly_the_poisoned_rows(kind, items):
    sigs = SignatureIndex()
    clean = make_mosaics(40, seed=0, source=items, signatures=sigs)
    params = {"wanet_strength": 2.0}
    pairs = add_backdoor(clean, 8, target_class=8, trigger=kind, seed=5, signatures=sigs, **params)
    rows = torch.nonzero(pairs.kind == BACKDOOR).flatten()
    rest = torch.nonzero(pairs.kind != BACKDOOR).flatten()
    assert torch.equal(pairs.images[rows], apply_trigger(clean.images[rows], kind, 5, **params))
    assert not torch.equal(pairs.images[rows], clean.images[rows])
    assert torch.equal(pairs.images[rest], clean.images[rest])


class _TriggerDetector(OracleCLIP):
    """OracleCLIP whose image side says 'bag' iff the image is one of a given set of (triggered) images,
    else 'cat' (its text side, hence the class embeddings, is OracleCLIP's)."""

    def __init__(self, tok, triggered: torch.Tensor):
        super().__init__(tok)
        self.keys = {bytes(t.numpy().tobytes()) for t in triggered}

    def encode_image(self, x):
        pix = ((x + 1) * 127.5).round().to(torch.uint8)
        hit = torch.tensor([bytes(p.numpy().tobytes()) in self.keys for p in pix])
        g = F.one_hot(torch.where(hit, 2, 0), 4).float()
        return ImageFeatures(g, g[:, None].expand(-1, 4, -1), torch.ones(len(x), 4, dtype=torch.bool))


@pytest.mark.parametrize("kind", ["badnets_random", "sig", "wanet"])
def test_asr_evaluation_applies_the_trained_trigger(kind):
    prompts = class_prompts(CLASSES)
    tok = WordTokenizer.from_texts([p for row in prompts for p in row])
    labels = torch.tensor([0, 1, 0, 1, 2, 0])
    test = LabeledSet(_textured(6, seed=1), labels)
    params = {"wanet_strength": 2.0, "sig_amplitude": 40.0}
    model = _TriggerDetector(tok, apply_trigger(test.images[labels != 2], kind, 9, **params))
    ce = ev.class_embeddings(model, tok, prompts, 8)
    assert ev.asr_backdoor(model, test, 2, kind, seed=9, class_emb=ce, **params) == 1.0
    # another seed (or other settings) is another trigger: this detector no longer fires
    assert ev.asr_backdoor(model, test, 2, kind, seed=9 if kind == "sig" else 10, class_emb=ce) == 0.0
