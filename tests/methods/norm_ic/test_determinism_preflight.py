"""Same seed, same SGNS vectors; models that are not available offline stop the run before any work."""

import time

import numpy as np
import pytest

from reprlab.errors import ModelNotAvailableError
from reprlab.methods.norm_ic.static import corpus_sentences, train_sgns
from reprlab.models.hf import check_model_available
from reprlab.runner import execute


def test_sgns_is_deterministic_for_a_seed():
    """gensim with 2 workers once gave different vectors run to run (25 summary keys differed)."""
    corpus = corpus_sentences("lee")[:150]
    a, ca = train_sgns(corpus, vector_size=16, epochs=1, min_count=3, seed=0)
    b, cb = train_sgns(corpus, vector_size=16, epochs=1, min_count=3, seed=0)
    assert a.words == b.words
    np.testing.assert_array_equal(a.vectors, b.vectors)  # bit-identical, not close
    np.testing.assert_array_equal(ca.vectors, cb.vectors)
    c, _ = train_sgns(corpus, vector_size=16, epochs=1, min_count=3, seed=1)
    assert not np.array_equal(a.vectors, c.vectors)  # the seed matters


def test_unavailable_model_fails_in_preflight_before_any_work(tmp_path):
    out = tmp_path / "run"
    t0 = time.perf_counter()
    with pytest.raises(ModelNotAvailableError, match="encoder.model 'no-such-org/no-such-model'") as err:
        execute("normic-tiny", ["encoder.model=no-such-org/no-such-model"], out=out, quiet=True)
    assert "all-minilm-l6-v2" in err.value.hint and "smollm2-135m-instruct" in err.value.hint
    assert not out.exists()  # stopped before the run folder (and GloVe/SGNS) was made
    assert time.perf_counter() - t0 < 60  # no corpus or SGNS work: generous bound for a loaded machine


def test_availability_resolves_aliases_folders_and_rejects_empty_folders(tmp_path):
    assert check_model_available("all-minilm-l6-v2") == "packaged"
    (tmp_path / "m").mkdir()
    with pytest.raises(ModelNotAvailableError, match="no config.json"):
        check_model_available(str(tmp_path / "m"))
    (tmp_path / "m" / "config.json").write_text("{}")
    assert check_model_available(str(tmp_path / "m")) == "folder"
