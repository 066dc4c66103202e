"""The web-like testbed (``data.testbed=fashion_web``) and the nearest-neighbour caption concept-match metric."""

import numpy as np
import pytest
import torch

from reprlab.assets import FASHION_MNIST_CLASSES, fashion_mnist
from reprlab.methods.otcclip.config import DataConfig
from reprlab.methods.otcclip.data.pairs import BACKDOOR, TARGETED
from reprlab.methods.otcclip.data.poison import mentions
from reprlab.methods.otcclip.data.testbed import build_testbed
from reprlab.methods.otcclip.data.web import GENERIC, SYNONYMS, make_web_pairs
from reprlab.methods.otcclip.evaluation.concept import nn_concept_match
from reprlab.methods.otcclip.pipeline.run import paired_differences

CFG = DataConfig(
    testbed="fashion_web",
    n_pairs=400,
    caption_noise=0.1,
    caption_noise_wrong=0.5,
    n_targets=2,
    captions_per_target=5,
    backdoor_pairs=10,
    n_eval=50,
    n_probe_train=50,
)


@pytest.fixture(scope="module")
def bed():
    return build_testbed(CFG, 0)


@pytest.fixture(scope="module")
def web():
    x, y = fashion_mnist("train")
    return make_web_pairs(400, 3, (x[:5000], y[:5000]), noise_share=0.1, wrong_share=0.5)


def names_of(cls: int) -> tuple[str, ...]:
    name = FASHION_MNIST_CLASSES[cls]
    return (name, *SYNONYMS[name])


def test_deterministic_per_seed(bed):
    again, other = build_testbed(CFG, 0), build_testbed(CFG, 1)
    assert torch.equal(bed.pairs.images, again.pairs.images) and bed.pairs.captions == again.pairs.captions
    assert torch.equal(bed.eval_set.images, again.eval_set.images)
    assert torch.equal(bed.targets.images, again.targets.images)
    assert bed.pairs.captions != other.pairs.captions
    assert not torch.equal(bed.pairs.images[:400], other.pairs.images[:400])


def test_declared_poison_and_noise_counts(bed):
    kind = bed.pairs.kind
    assert len(bed.pairs) == 400 + 2 * 5
    assert int((kind == TARGETED).sum()) == 10 and int((kind == BACKDOOR).sum()) == 10
    assert bed.caption_noise == {"generic": 20, "wrong": 20} and len(bed.noisy_rows) == 40
    assert bed.eval_set.images.shape == (50, 1, 56, 56) and bed.targets.images.shape == (2, 1, 56, 56)


def test_poison_free_control_keeps_the_targets_and_clean_pairs(bed):
    """The matched null (no poison pairs) is the same testbed without the attacker's rows: the same
    targets to score, and the clean pairs the backdoor would have overwritten keep their own captions."""
    from dataclasses import replace

    null = build_testbed(replace(CFG, captions_per_target=0, backdoor_pairs=0), 0)
    assert len(null.pairs) == 400 and bool((null.pairs.kind == 0).all())
    assert torch.equal(null.targets.images, bed.targets.images)
    assert torch.equal(null.targets.target, bed.targets.target)
    clean = bed.pairs.kind[:400] == 0
    assert torch.equal(null.pairs.images[:400][clean], bed.pairs.images[:400][clean])
    assert [c for c, k in zip(null.pairs.captions, clean.tolist()) if k] == [
        c for c, k in zip(bed.pairs.captions[:400], clean.tolist()) if k
    ]


def test_many_images_per_concept(web):
    counts = np.bincount(web.labels.numpy(), minlength=10)
    assert counts.min() >= 20  # 400 items over 10 classes: ~40 each, every concept seen many times


def test_captions_name_the_item_and_noise_is_as_declared(web):
    """Clean captions name the item's class (by name or synonym) and no other; generic noise names none;
    wrong-class noise names another class. Fails if captions stop describing the image."""
    noisy = set(web.noisy.tolist())
    n_generic = n_wrong = 0
    for r, (cap, cls) in enumerate(zip(web.pairs.captions, web.labels.tolist())):
        named = {c for c in range(10) if any(mentions(cap, n) for n in names_of(c))}
        if r not in noisy:
            assert named == {cls}, (cap, FASHION_MNIST_CLASSES[cls])
        elif cap in GENERIC:
            n_generic += 1
            assert named == set()
        else:
            n_wrong += 1
            assert len(named) == 1 and cls not in named, cap
    assert (n_generic, n_wrong) == (web.n_generic, web.n_wrong) == (20, 20)
    # the concept id of a clean caption is its class: equal sigs <=> equal classes
    clean = torch.tensor(sorted(set(range(400)) - noisy))
    sig, lab = web.pairs.sig[clean], web.labels[clean]
    assert torch.equal(sig[:, None] == sig[None], lab[:, None] == lab[None])


def test_attribute_words_are_read_from_the_image(web):
    """'on the left/right', 'small/large', 'dark/light' in a caption agree with the pixels."""
    img = web.pairs.images[:, 0].float()
    cols = torch.arange(56.0)
    checked = 0
    for r, cap in enumerate(web.pairs.captions):
        fg = img[r] > 60  # item pixels (background noise sd <= 12)
        if not fg.any():
            continue
        centre = (fg.float().sum(0) * cols).sum() / fg.sum()
        extent = max(int(fg.any(0).sum()), int(fg.any(1).sum()))  # the item's longer side in px
        if " on the left" in cap:
            assert centre < 28, cap
            checked += 1
        if " on the right" in cap:
            assert centre > 28, cap
            checked += 1
        if cap.split(" ")[0:1] == ["small"] or " small " in f" {cap} ":
            assert extent <= 31, cap  # small: drawn at <= 31 px
        if " large " in f" {cap} ":
            assert extent >= 22, (
                cap
            )  # large: drawn at >= 39 px; dark items lose faint pixels to the threshold
    assert checked > 20


def test_concept_match_hand_computed():
    img = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    txt = torch.tensor([[1.0, 0.0], [0.6, 0.8], [0.0, 1.0]])
    sig = torch.tensor([0, 1, 0])
    # own caption excluded: image 0 -> caption 1 (sig 1, miss), image 1 -> caption 2 (sig 0, miss),
    # image 2 -> caption 0 (sig 0, hit)
    assert nn_concept_match(img, txt, sig, torch.tensor([0, 1, 2]), bank_size=10, seed=0) == pytest.approx(
        1 / 3
    )
    assert nn_concept_match(img, txt, sig, torch.tensor([2]), bank_size=10, seed=0) == 1.0
    # a bank of one caption: each chunk draws one random caption; image 2 hits only on caption 0
    got = nn_concept_match(img, txt, sig, torch.tensor([2]), bank_size=1, seed=0)
    assert got in (0.0, 1.0)
    assert np.isnan(nn_concept_match(img, txt, sig, torch.tensor([], dtype=torch.long), 10, 0))


def test_paired_differences():
    res = {
        "none": {"zeroshot_acc": 0.5, "linear_probe_acc": 0.6},
        "roclip": {"zeroshot_acc": 0.45, "linear_probe_acc": 0.62},
        "safeclip": {"zeroshot_acc": 0.52, "linear_probe_acc": 0.58},
        "otcclip": {"zeroshot_acc": 0.5, "linear_probe_acc": 0.7},
    }
    out = paired_differences(res)
    assert out["paired.roclip_vs_none.zeroshot"] == pytest.approx(-0.05)
    assert out["paired.otcclip_vs_best.zeroshot"] == pytest.approx(-0.02)
    assert out["paired.otcclip_vs_best.probe"] == pytest.approx(0.08)
