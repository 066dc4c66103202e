"""Evaluation metrics against an oracle model whose answers we know."""

import numpy as np
import pytest
import torch
from sklearn.linear_model import LogisticRegression

from reprlab.methods.otcclip.data.mosaic import class_prompts
from reprlab.methods.otcclip.data.pairs import LabeledSet
from reprlab.methods.otcclip.data.poison import TargetSet
from reprlab.methods.otcclip.data.tokenizer import WordTokenizer
from reprlab.methods.otcclip.data.triggers import apply_trigger
from reprlab.methods.otcclip.evaluation import metrics as ev
from reprlab.methods.otcclip.models.embed import embed_images

from .otcclip_oracle import CLASSES, OracleCLIP


@pytest.fixture
def setup():
    prompts = class_prompts(CLASSES)
    tok = WordTokenizer.from_texts([p for row in prompts for p in row])
    labels = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    images = (labels * 80).to(torch.uint8)[:, None, None, None].expand(-1, 1, 56, 56).clone()
    return OracleCLIP(tok), tok, prompts, LabeledSet(images, labels)


def test_zero_shot_and_asrs_against_the_oracle(setup):
    model, tok, prompts, test = setup
    ce = ev.class_embeddings(model, tok, prompts, 8)
    assert torch.allclose(ce, torch.eye(4)[:3])
    assert ev.zero_shot_accuracy(model, test, ce) == 1.0
    # two targets: one whose image shows its target class (success), one that does not
    tg = TargetSet(test.images[[0, 1]], torch.tensor([0, 1]), torch.tensor([0, 2]))
    assert ev.asr_targeted(model, tg, ce) == 0.5
    # every triggered non-bag image flips to bag -> ASR 1; bag images are excluded from the denominator
    assert ev.asr_backdoor(model, test, 2, "badnets", seed=0, class_emb=ce) == 1.0
    # a blended trigger this oracle ignores -> ASR 0
    assert ev.asr_backdoor(model, test, 2, "blended", seed=0, class_emb=ce) == 0.0
    assert apply_trigger(test.images, "badnets", 0).shape == test.images.shape


def test_linear_probe_matches_sklearn_on_the_same_features(setup):
    model, _, _, test = setup
    feats = embed_images(model, test.images).numpy()
    clf = LogisticRegression(C=1.0, max_iter=1000).fit(feats, test.labels.numpy())
    ref = float(np.mean(clf.predict(feats) == test.labels.numpy()))
    assert ev.linear_probe_accuracy(model, test, test) == ref == 1.0
