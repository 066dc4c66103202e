"""Copies of one image count as one pair (``defense.copies_weight``): the weights, and their place in OTCCLIP's
step. Checked by breaking it on purpose: the weights left out of the step, and the count taken over all images
instead of one key, each fail a test here."""

import pytest
import torch

import reprlab.methods.otcclip.defenses.otcclip as otc_module
from reprlab.methods.otcclip.config import DefenseConfig
from reprlab.methods.otcclip.data.pairs import TARGETED, PairSet
from reprlab.methods.otcclip.data.testbed import build_testbed
from reprlab.methods.otcclip.data.tokenizer import WordTokenizer
from reprlab.methods.otcclip.defenses.copies import copy_weights, image_keys
from reprlab.methods.otcclip.training.trainer import Trainer

from .planted import TRAIN, PlantedCLIP, planted_pairs

ALL = torch.arange(16)


def _images(seed: int, n: int) -> torch.Tensor:
    return torch.randint(
        0, 256, (n, 1, 28, 28), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8
    )


def test_each_set_of_copies_weighs_one_pair():
    base = _images(0, 5)
    images = torch.cat([base[:1].expand(4, -1, -1, -1), base[1:2].expand(2, -1, -1, -1), base[2:]])
    for grid in (16, 0):
        w = copy_weights(images, grid)
        assert torch.equal(w, torch.tensor([0.25] * 4 + [0.5] * 2 + [1.0] * 3)), grid
        assert float(w.sum()) == pytest.approx(5.0)  # five distinct images, five pairs' worth
    # a copy brightened by one level keeps its average hash (every cell and the mean move together); exact
    # pixels (grid 0) tell it apart
    brighter = (base[:1].int() + 1).clamp(max=255).to(torch.uint8)
    assert image_keys(brighter, 16) == image_keys(base[:1], 16)
    assert image_keys(brighter, 0) != image_keys(base[:1], 0)
    assert torch.equal(copy_weights(torch.cat([base[:1], brighter]), 0), torch.ones(2))


def test_the_targeted_poisons_of_the_testbed_weigh_one_pair_per_target():
    from .test_recipe import _cfg

    pairs = build_testbed(_cfg().data, 0).pairs
    w = copy_weights(pairs.images)
    targeted = pairs.kind == TARGETED
    n_targets, per_target = 2, 4  # test_recipe's MINI
    assert torch.allclose(w[targeted], torch.full((n_targets * per_target,), 1 / per_target))
    assert float(w[targeted].sum()) == pytest.approx(n_targets)
    assert float((w[~targeted] == 1).float().mean()) >= 0.95  # clean look-alikes are rare


def _trainer(copies: bool, pairs: PairSet) -> Trainer:
    tok = WordTokenizer.from_texts(pairs.captions)
    # exact pixels: the planted images are flat, and every flat image has the same average hash
    cfg = DefenseConfig(
        rematch=False, lambda_inter=0.0, lambda_intra=0.0, copies_weight=copies, copies_hash=0
    )
    return Trainer(PlantedCLIP(tok), pairs, tok, "otcclip", TRAIN, cfg, seed=0)


def _row_weight_of_a_step(monkeypatch, tr: Trainer):
    seen = []

    def spy(img, txt, scale, negative_mask=None, row_weight=None):
        seen.append(row_weight)
        return real(img, txt, scale, negative_mask, row_weight)

    real = otc_module.clip_loss
    monkeypatch.setattr(otc_module, "clip_loss", spy)
    out = tr.step(ALL, 0, 0, tr.phase(0))
    return seen[0], out.loss


def test_otcclip_weighs_each_pair_by_its_copies(monkeypatch):
    # the planted images are one constant image per class: class 0 has 3 clean + 4 poison copies, the
    # other three classes 3 copies each
    pairs = planted_pairs()
    w, loss_on = _row_weight_of_a_step(monkeypatch, _trainer(True, pairs))
    expected = torch.tensor([1 / 7] * 3 + [1 / 3] * 9 + [1 / 7] * 4)
    assert w is not None and torch.allclose(w.cpu(), expected)
    off, loss_off = _row_weight_of_a_step(monkeypatch, _trainer(False, pairs))
    assert off is None and loss_on != pytest.approx(loss_off)


def test_without_copies_the_option_leaves_the_step_unweighted(monkeypatch):
    pairs = planted_pairs()
    distinct = PairSet(
        _images(1, 16), pairs.captions, pairs.kind, pairs.sig, pairs.image_id, class_names=pairs.class_names
    )
    w, loss_on = _row_weight_of_a_step(monkeypatch, _trainer(True, distinct))
    _, loss_off = _row_weight_of_a_step(monkeypatch, _trainer(False, distinct))
    assert w is None and loss_on == loss_off  # the same path: bit for bit
