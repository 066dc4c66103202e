"""The blend veto on OTCCLIP's release [ours] (``defense.flag_release_veto``, ``defenses/blend.py``).

* on a tower whose answer is known (the image feature is its mean pixel), the veto keeps flagged the released
  images whose fit survives the blend (a bright patch), the rounded share of them, and with
  ``flag_release_together`` their copies;
* inside the trainer the release hands back the planted clean pairs less the vetoed one, and logs the count;
* a veto without a release is refused by name.

Checked by breaking it on purpose (then restoring it): the order of the blend score reversed (the dim images
vetoed), the veto not applied in the trainer's release.
"""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from reprlab.errors import ConfigError
from reprlab.methods.otcclip.defenses import blend
from reprlab.methods.otcclip.defenses.release import veto, veto_seed

from .test_consensus_flag import _flagged_trainer
from .test_flag_probe import _Mean


def _known_tower(monkeypatch):
    monkeypatch.setattr(blend, "embed_images", lambda model, x: model.encode_image(x.float()).global_)
    return _Mean()


def test_the_veto_keeps_flagged_the_released_images_a_patch_carries_through_the_blend(monkeypatch):
    """Ten released images, dark (mean 10) but for pairs 2, 5 and 7, which carry a bright 16 x 16 patch; pair 8 is a
    copy of pair 7 (its caption too) and stays flagged with it only when copies go together. Accepted pairs 10-13
    are black. Blended half into black, a patched image keeps the larger mean, so its caption (1, 0) keeps the
    larger cosine: a share 0.3 of the nine released vetoes the three patched ones (a share 0.25, rounded to 2, the
    two brightest)."""
    model = _known_tower(monkeypatch)
    images = torch.full((14, 1, 32, 32), 10, dtype=torch.uint8)
    images[10:] = 0
    for i, bright in ((2, 200), (5, 240), (7, 255), (8, 255)):
        images[i, :, :16, :16] = bright
    txt = torch.tensor([[1.0, 0.0]]).expand(14, 2)
    img = F.normalize(torch.eye(14), dim=-1)
    img[8] = img[7]  # the copy
    safe = torch.arange(14) >= 10
    back = torch.zeros(14, dtype=torch.bool)
    back[[0, 1, 2, 3, 4, 5, 6, 7, 9]] = True  # pair 8 stays flagged by the release itself

    def cfg(share, together=False):
        return SimpleNamespace(
            flag_release_veto=share, flag_release_together=together, flag_duplicate_cos=0.999
        )

    got = veto(cfg(0.3), back, safe, img, model, images, txt, seed=0)
    assert (back & ~got).nonzero().flatten().tolist() == [2, 5, 7]  # round(0.3 x 9) = 3 vetoed
    got = veto(cfg(0.25), back, safe, img, model, images, txt, seed=0)
    assert (back & ~got).nonzero().flatten().tolist() == [5, 7]  # round(2.25) = 2: the brightest two
    assert torch.equal(veto(cfg(0.0), back, safe, img, model, images, txt, seed=0), back)  # off
    # copies: with 8 released too, a share 0.1 of ten vetoes one pair, 7 (its tie with 8 goes to the lower
    # index); one by one 8 is released, together it stays flagged with 7
    back[8] = True
    alone = veto(cfg(0.1), back, safe, img, model, images, txt, seed=0)
    assert (back & ~alone).nonzero().flatten().tolist() == [7]
    both = veto(cfg(0.1, together=True), back, safe, img, model, images, txt, seed=0)
    assert (back & ~both).nonzero().flatten().tolist() == [7, 8]


def test_the_trainers_release_hands_back_the_planted_pairs_less_the_vetoed_one(monkeypatch):
    """The planted release of test_consensus_flag (clean pairs 0 and 6 flagged and released, poisons 12-13 kept)
    with a veto of share 0.5: one of the two stays flagged, the one with the larger blend score (a stand-in score,
    the mean pixel, so the answer is read from the images), and the log counts it."""
    monkeypatch.setattr(blend, "blend_cosine", lambda model, x, txt, bgs: x.float().mean(dim=(1, 2, 3)))
    kw = dict(flag_start=9, flag_until=9, flag_k=2, flag_duplicate_cos=2.0, flag_release_epoch=1)
    flagged = torch.zeros(16, dtype=torch.bool)
    flagged[[0, 6, 12, 13]] = True
    tr = _flagged_trainer(flag_release_quantile=0.75, flag_release_veto=0.5, **kw)
    tr.state.safe.copy_(~flagged)
    bright = tr.data.images.float().mean(dim=(1, 2, 3))
    assert bright[0] != bright[6]  # the planted images differ, so the answer is not a tie
    kept = 0 if bright[0] > bright[6] else 6
    stats = tr.impl.start_epoch(tr, 1, "otc")
    assert stats["released"] == 1 and stats["release_vetoed"] == 1
    assert (~tr.state.safe.cpu()).nonzero().flatten().tolist() == sorted([kept, 12, 13])


def test_the_veto_seed_is_fixed_per_run_and_epoch():
    # the trainer and the flag probe draw the backgrounds from it, so a resumed run and the probe draw the same ones
    assert veto_seed(3, 10) == veto_seed(3, 10) != veto_seed(3, 11)
    assert veto_seed(0, 10) != veto_seed(1, 10)


def test_a_veto_without_a_release_is_refused_by_name():
    with pytest.raises(ConfigError, match="flag_release_veto.*flag_release_epoch"):
        _flagged_trainer(flag_release_veto=0.3, flag_release_epoch=-1)
