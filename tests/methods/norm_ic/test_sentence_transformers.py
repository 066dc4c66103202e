"""Norm-IC on a sentence-transformers pipeline: its own pooling, its transformer's token states.

Oracles: ``SentenceTransformer(path).encode`` for the pooled vector, and the summary of the same small run
made on main before this loading existed (pinned, provenance in the JSON file) for every other figure.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from reprlab.cli import execute
from reprlab.errors import ModelNotAvailableError
from reprlab.jsonfile import null_as_nan
from reprlab.methods.norm_ic.extract import extract_states
from reprlab.models.hf import _resolve
from reprlab.models.sentence import is_sentence_transformer, load_sentence_pipeline

SMALL = [
    "ic.corpus=lee", "vocab.n_eval=100", "vocab.n_fit=150", "vocab.top_k=8000", "decoder.enabled=false",
    "static.glove=false", "static.sgns=false", "encoder.layers=[-1]", "analysis.n_boot=20",
    "analysis.compositions=[sum,mean,ind,pooled]", "analysis.n_perm=200", "length.n_docs=2", "length.n_words=12",
    "length.n_points=4", "length.natural=lee", "length.compositions=[sum,mean,pooled]", "length.null_dim=0",
]  # fmt: skip
PINNED = json.loads((Path(__file__).parent / "minilm_cls_summary_0e6ca91.json").read_text())["summary"]
TEXTS = ["serendipity", "the", "A man is eating food.", "Someone is having a meal.", "antidisestablishmentarianism",
         "The stock market crashed on Monday, and nobody knew why."]  # fmt: skip


@pytest.fixture(scope="module")
def pipe():
    return load_sentence_pipeline("all-minilm-l6-v2")


def test_the_packaged_minilm_is_detected_by_its_modules_json(tmp_path):
    assert is_sentence_transformer("all-minilm-l6-v2")
    assert not is_sentence_transformer("smollm2-135m-instruct")  # a GGUF file, no pipeline
    plain = shutil.copytree(_resolve("all-minilm-l6-v2")[0], tmp_path / "plain")
    assert is_sentence_transformer(str(plain))
    (plain / "modules.json").unlink()  # a plain HF encoder folder keeps the AutoModel path
    assert not is_sentence_transformer(str(plain))


def test_pooled_vectors_equal_sentence_transformers_encode(pipe):
    from sentence_transformers import SentenceTransformer

    assert (pipe.pooling, pipe.normalize) == ("mean", True)
    assert pipe.describe() == "mean, normalize: true (from modules.json)"
    st = SentenceTransformer(_resolve("all-minilm-l6-v2")[0], device="cpu")
    ref = st.encode(TEXTS, convert_to_tensor=True, batch_size=4)
    got = extract_states(
        pipe.model, pipe.tokenizer, TEXTS, "encoder", layers=[-1], batch_size=3, pool=pipe.pool
    )
    # same weights and modules, other batches: other padding widths, so other matmul shapes; unit vectors,
    # float32 rounding ~1e-7 per op over 6 blocks: 1e-5
    torch.testing.assert_close(got.pooled[:, 0], ref, rtol=0, atol=1e-5)
    cls = extract_states(pipe.model, pipe.tokenizer, TEXTS, "encoder", layers=[-1], batch_size=3)
    assert (cls.pooled[:, 0] - ref).abs().max() > 0.1  # the CLS state is another vector: the test can fail
    torch.testing.assert_close(got.states, cls.states)  # token states do not depend on the pooling
    unnormalized = extract_states(pipe.model, pipe.tokenizer, TEXTS, "encoder", layers=[-1],
                                  pool=lambda h, m: pipe.pool(h, m, normalize=False))  # fmt: skip
    norms = unnormalized.pooled[:, 0].norm(dim=-1)
    assert norms.std() > 0.01  # what pooling=model_unnormalized gives Norm-IC: norms that vary
    torch.testing.assert_close(unnormalized.pooled[:, 0] / norms[:, None], ref, rtol=0, atol=1e-5)


def test_a_missing_sentence_transformers_names_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "sentence_transformers" else real(name, *a))  # fmt: skip
    with pytest.raises(ModelNotAvailableError) as err:
        load_sentence_pipeline("all-minilm-l6-v2")
    assert "reprlab[normic]" in err.value.hint


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("normic-st")
    out = {}
    for pooling in ("model", "special_token"):
        folder = execute(
            "normic-tiny", [*SMALL, f"encoder.pooling={pooling}"], out=root / pooling, quiet=True
        )
        out[pooling] = null_as_nan(json.loads((folder / "summary.json").read_text()))  # null (+ reason) = NaN
    return out


def _same(a, b) -> bool:
    # the pinned values come from another run of the same code path on possibly another CPU: MiniLM's forward
    # may differ by ~1e-7 relative between AVX2 and AVX-512 kernels, which moves correlations and bootstrap
    # quantiles by far less than 1e-4; CLS against mean pooling moves them by > 0.05
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or abs(a - b) <= 1e-4
    return a == b


def test_cls_pooling_gives_todays_figures(runs):
    """pooling=special_token through sentence-transformers: every figure as main's AutoModel run (CLS)."""
    s = runs["special_token"]
    assert s["minilm.pooling"].startswith("cls (the CLS state); the pipeline's own (mean, normalize: true")
    bad = [k for k in PINNED if not _same(PINNED[k], s[k])]
    assert not bad, [(k, PINNED[k], s[k]) for k in bad[:5]]


def test_the_models_own_pooling_changes_only_the_pooled_figures(runs):
    s = runs["model"]
    assert s["minilm.pooling"] == "mean, normalize: true (from modules.json)"
    pooled = {k for k in PINNED if ".pooled" in k} | {"minilm_L6.cer_r2", "minilm_L6.cer_r2_natural"}  # head
    bad = [k for k in PINNED if k not in pooled and not _same(PINNED[k], s[k])]
    assert not bad, [(k, PINNED[k], s[k]) for k in bad[:5]]
    # after Normalize every ‖pooled‖² is 1: the raw correlation is undefined, not a number from rounding noise
    assert math.isnan(s["minilm_L6.pooled.spearman"]) and math.isnan(s["minilm_L6.pooled.cer_r2"])
    assert not math.isnan(PINNED["minilm_L6.pooled.spearman"])
    # centred, the unit vectors' norms vary again, and differ from the CLS state's
    assert (
        abs(s["minilm_L6.pooled@center_zipf.spearman"] - PINNED["minilm_L6.pooled@center_zipf.spearman"])
        > 0.05
    )
    # the fixed-point statistic reads directions: defined for the normalised vectors too
    assert 0 < s["minilm_L6.pooled.fixed_cos_natural"] <= 1 + 1e-6
