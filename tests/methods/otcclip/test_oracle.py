"""The poison-free oracle: the reference model trained on the pairs not marked as poisons, everything else as
the defenses have it."""

from types import SimpleNamespace

import pytest
import torch

from reprlab.errors import ConfigError
from reprlab.methods.otcclip import recipe
from reprlab.methods.otcclip.data.pairs import BACKDOOR, TARGETED
from reprlab.methods.otcclip.data.testbed import build_testbed
from reprlab.methods.otcclip.data.tokenizer import WordTokenizer
from reprlab.methods.otcclip.pipeline import fit

from .test_recipe import _cfg


class _Seen(Exception):
    pass


def _pairs_trained_on(monkeypatch, defense: str, cfg, bed):
    """The PairSet ``train_defense`` hands the trainer (the spy stops the run there)."""

    def spy(model, pairs, *args, **kwargs):
        raise _Seen(pairs)

    monkeypatch.setattr(fit, "Trainer", spy)
    tok = WordTokenizer.from_texts(bed.pairs.captions)
    with pytest.raises(_Seen) as seen:
        fit.train_defense(defense, cfg, SimpleNamespace(device=torch.device("cpu")), bed, tok)
    return seen.value.args[0]


def test_the_oracle_trains_on_the_unpoisoned_pairs_and_the_others_on_all(monkeypatch):
    cfg = _cfg()
    bed = build_testbed(cfg.data, 0)
    kind = bed.pairs.kind
    assert int((kind == TARGETED).sum()) > 0 and int((kind == BACKDOOR).sum()) > 0
    oracle = _pairs_trained_on(monkeypatch, "oracle", cfg, bed)
    clean = torch.nonzero(kind == 0).flatten()
    assert len(oracle) == len(clean) and bool((oracle.kind == 0).all())
    assert torch.equal(oracle.images, bed.pairs.images[clean])
    assert oracle.captions == [bed.pairs.captions[i] for i in clean.tolist()]
    assert torch.equal(oracle.sig, bed.pairs.sig[clean]) and torch.equal(
        oracle.image_id, bed.pairs.image_id[clean]
    )
    for defense in ("none", "cleanclip"):
        assert _pairs_trained_on(monkeypatch, defense, cfg, bed) is bed.pairs


def test_select_by_mask_and_by_index_agree():
    pairs = build_testbed(_cfg().data, 1).pairs
    mask = pairs.kind != 0
    a, b = pairs.select(mask), pairs.select(torch.nonzero(mask).flatten())
    assert len(a) == int(mask.sum()) and a.captions == b.captions and torch.equal(a.images, b.images)


def test_the_oracle_refuses_a_stream():
    with pytest.raises(ConfigError, match="in-memory testbed only"):
        recipe.preflight(
            _cfg(["stream.write_shards=true", "data.clean_finetune_pairs=0", "defenses=[none,oracle]"])
        )
    recipe.preflight(_cfg(["defenses=[none,oracle]"]))
