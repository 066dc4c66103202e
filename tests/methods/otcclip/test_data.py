"""Tokenizer, mosaic testbed and poisons."""

import numpy as np
import pytest
import torch

from reprlab.assets import FASHION_MNIST_CLASSES
from reprlab.methods.otcclip.data.mosaic import POSITIONS, make_mosaics, make_single_items  # fmt: skip
from reprlab.methods.otcclip.data.pairs import BACKDOOR, TARGETED, SignatureIndex  # fmt: skip
from reprlab.methods.otcclip.data.poison import add_backdoor, add_targeted, mentions
from reprlab.methods.otcclip.data.tokenizer import WordTokenizer, words
from reprlab.methods.otcclip.data.triggers import apply_trigger, trigger_pattern


def test_tokenizer_roundtrip_unknown_and_empty():
    tok = WordTokenizer.from_texts(["a t-shirt top left", "a shirt"])
    ids, mask = tok.encode(["a t-shirt top left", "a zebra", ""], max_len=6)
    assert ids.shape == (3, 6) and mask.sum(1).tolist() == [4, 2, 1]
    assert tok.decode(ids)[0] == "a t-shirt top left"
    assert tok.decode(ids)[1] == "a <unk>"  # unseen word
    assert ids[2, 0] == 1  # empty caption -> one <unk>, never an all-padding row
    assert words("A T-Shirt, top-left!") == ["a", "t-shirt", "top-left"]
    with pytest.raises(ValueError):
        WordTokenizer(["a", "b"])


def test_mosaics_are_deterministic_and_captions_name_every_item(items):
    a = make_mosaics(40, seed=3, source=items)
    b = make_mosaics(40, seed=3, source=items)
    assert torch.equal(a.images, b.images) and a.captions == b.captions
    assert a.images.shape == (40, 1, 56, 56) and a.images.dtype == torch.uint8
    for img, cap in zip(a.images, a.captions):
        filled = [
            q
            for q in range(4)
            if img[0, (q // 2) * 28 : (q // 2 + 1) * 28, (q % 2) * 28 : (q % 2 + 1) * 28].any()
        ]
        named = [q for q, pos in enumerate(POSITIONS) if pos in cap]
        assert filled == named  # each filled quadrant, and only those, is named by position
        n_classes = sum(mentions(cap, c) for c in FASHION_MNIST_CLASSES)
        assert 1 <= n_classes <= len(filled)
    assert make_mosaics(5, seed=0, source=items, tint=True).images.shape[1] == 3


def test_single_items_fill_one_quadrant(items):
    s = make_single_items(items[0][:20], items[1][:20], seed=0)
    filled = [(s.images[i, 0].reshape(2, 28, 2, 28) > 0).any(-1).any(-2).sum() for i in range(20)]
    assert all(f == 1 for f in filled) and torch.equal(s.labels, torch.as_tensor(items[1][:20]))


def test_mentions_is_whole_word_and_hyphen_aware():
    assert mentions("a t-shirt top left", "t-shirt") and not mentions("a t-shirt top left", "shirt")
    assert mentions("a shirt, a bag", "shirt") and not mentions("a bags", "bag")


def test_targeted_poisons_pair_each_target_with_captions_naming_its_wrong_class(items):
    sigs = SignatureIndex()
    clean = make_mosaics(300, seed=0, source=items, signatures=sigs)
    pairs, tg = add_targeted(clean, items[0], items[1], n_targets=3, n_captions=5, seed=1)
    assert len(pairs) == 315 and int((pairs.kind == TARGETED).sum()) == 15
    assert (tg.target != tg.true).all()
    for t in range(3):
        rows = torch.arange(300 + 5 * t, 300 + 5 * (t + 1))
        assert all(torch.equal(pairs.images[r], tg.images[t]) for r in rows)
        assert all(mentions(pairs.captions[r], FASHION_MNIST_CLASSES[int(tg.target[t])]) for r in rows)
        assert all(pairs.captions[r] in clean.captions for r in rows)  # natural training captions
    with pytest.raises(ValueError, match="mention"):
        add_targeted(clean, items[0], items[1], n_targets=1, n_captions=10_000, seed=1)


def test_backdoor_trigger_and_captions(items):
    sigs = SignatureIndex()
    clean = make_mosaics(50, seed=0, source=items, signatures=sigs)
    pairs = add_backdoor(clean, n_poison=10, target_class=8, trigger="badnets", seed=5, signatures=sigs)
    rows = torch.nonzero(pairs.kind == BACKDOOR).flatten()
    assert len(rows) == 10 and all("bag" in pairs.captions[r] for r in rows)
    patch = trigger_pattern("badnets", (1, 56, 56), seed=5)
    assert torch.equal(pairs.images[rows][:, :, -8:, -8:].float(), patch.expand(10, -1, -1, -1))
    untouched = torch.nonzero(pairs.kind == 0).flatten()
    assert torch.equal(pairs.images[untouched], clean.images[untouched])
    # blended: x' = 0.8 x + 0.2 noise (CleanCLIP), checked against the formula
    x = torch.full((2, 1, 56, 56), 100, dtype=torch.uint8)
    noise = trigger_pattern("blended", (1, 56, 56), seed=1)
    expect = (0.8 * 100 + 0.2 * noise).round()
    # exact: rounded integers, 0.2 k is >= 0.1 from a .5 boundary
    assert torch.equal(apply_trigger(x, "blended", seed=1).float(), expect.expand(2, -1, -1, -1))
    with pytest.raises(ValueError, match="trigger"):
        apply_trigger(x, "bogus", seed=1)
    assert np.isclose(float(pairs.kind.ne(0).float().mean()), 0.2)


def test_generated_shapes_are_balanced_deterministic_and_captioned_by_shape_name():
    from reprlab.methods.otcclip.data.shapes import SHAPES, make_shape_items

    x, y = make_shape_items(60, seed=0)
    x2, _ = make_shape_items(60, seed=0)
    assert np.array_equal(x, x2) and np.bincount(y).tolist() == [10] * 6
    assert all(x[i].max() >= 170 for i in range(60))  # every item has a drawn shape
    # classes differ in pixel area on average (an oracle that the drawings are not all alike)
    areas = [float((x[y == c] > 0).mean()) for c in range(6)]
    assert len({round(a, 3) for a in areas}) == 6
    pairs = make_mosaics(20, seed=0, source=(x, y), tint=True, class_names=SHAPES)
    assert pairs.class_names == SHAPES and pairs.images.shape[1] == 3
    assert all(any(mentions(c, s) for s in SHAPES) for c in pairs.captions)
