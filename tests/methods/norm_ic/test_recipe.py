"""End to end: the normic-tiny recipe on a shrunken config, checked against independent scipy oracles."""

import json

import numpy as np
import pytest
import torch
from scipy import stats as sps

from reprlab.cli import execute
from reprlab.methods.norm_ic.recipe import report_sections
from reprlab.methods.norm_ic.static import load_glove
from tests.micro_runs import NORMIC_MICRO

# the shrunken fit vocabulary (250 words) is below the 384-d whitening the recipe warns about: expected here
pytestmark = pytest.mark.filterwarnings("ignore:whitening .* fit rows; the estimate is noisy:UserWarning")

SMALL = NORMIC_MICRO  # the micro variant every session runs once (tests/micro_runs.py)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, micro_runs):
    """A copy of the session's micro Norm-IC run (the same SMALL overrides, tests/micro_runs.py): these tests
    resume into it, so they get their own folder."""
    import shutil

    out = tmp_path_factory.mktemp("normic") / "run"
    shutil.copytree(micro_runs["normic-tiny"], out)
    return out


def test_summary_has_the_issue_keys_with_consistent_cis(tiny_run):
    s = json.loads((tiny_run / "summary.json").read_text())
    for src, comp in [("glove", "word"), ("sgns", "word"), ("minilm_L6", "sum"), ("minilm_L6", "pooled")]:
        for stat in ("spearman", "pearson"):
            est, lo, hi = (s[f"{src}.{comp}.{stat}{x}"] for x in ("", "_lo", "_hi"))
            assert -1 <= lo <= est <= hi <= 1, (src, comp, stat)
    for src in ("glove", "sgns", "minilm_L6"):
        assert 0 <= s[f"{src}.cer_r2"] <= 1
    assert "glove.word@whiten_zipf.spearman" in s


def test_glove_correlation_matches_scipy_on_raw_arrays(tiny_run):
    """Oracle: recompute GloVe's raw correlation from the saved eval words with numpy + scipy alone."""
    s = json.loads((tiny_run / "summary.json").read_text())
    words = json.loads((tiny_run / "stages" / "setup.json").read_text())["result"]["eval_words"]
    import wordfreq

    ic = -np.log([wordfreq.word_frequency(w, "en") for w in words])
    sq = (load_glove().lookup(words).astype(np.float64) ** 2).sum(1)
    assert s["glove.word.spearman"] == pytest.approx(sps.spearmanr(ic, sq).statistic, abs=1e-9)
    assert s["glove.word.pearson"] == pytest.approx(sps.pearsonr(ic, sq).statistic, abs=1e-9)


def test_same_seed_same_summary(tiny_run, tmp_path):
    """Two identical runs once differed in 25 ``sgns.*`` keys (gensim with 2 workers). Now bit-identical."""
    again = execute("normic-tiny", SMALL, out=tmp_path / "again", quiet=True)
    a = json.loads((tiny_run / "summary.json").read_text())
    b = json.loads((again / "summary.json").read_text())
    a.pop("wall_time_s"), b.pop("wall_time_s")
    assert any(k.startswith("sgns.") for k in a)
    diff = [k for k in a if k not in b or not (a[k] == b[k] or (a[k] != a[k] and b[k] != b[k]))]  # NaN == NaN
    assert not diff and a.keys() == b.keys(), diff[:10]


def test_nulls_cer_cis_and_claims_in_the_summary(tiny_run):
    s = json.loads((tiny_run / "summary.json").read_text())
    for comp in ("sum", "ind", "joint", "mean"):
        key = f"minilm_L6.{comp}"
        assert s[f"{key}.verdict"] in (-1, 0, 1)
        assert s[f"{key}.null_random.diff_lo"] <= s[f"{key}.null_random.diff_hi"]
        assert s[f"{key}.null_shuffle.lo"] < 0 < s[f"{key}.null_shuffle.hi"]
        # the paired difference CI brackets the point difference (same resamples on both sides)
        d = s[f"{key}.spearman"] - s[f"{key}.null_random.spearman"]
        assert s[f"{key}.null_random.diff_lo"] - 1e-9 <= d <= s[f"{key}.null_random.diff_hi"] + 1e-9
    # undefined (CLS has no random-piece analogue): written as null, with the reason beside it
    assert "minilm_L6.pooled.null_random.spearman" in s and s["minilm_L6.pooled.null_random.spearman"] is None
    assert "no random-piece analogue" in s["minilm_L6.pooled.null_random.spearman.null_reason"]
    assert -1 <= s["minilm_L6.piece_count.spearman"] <= 1
    for key in (
        "minilm_L6.pooled.fixed_cos",
        "minilm_L6.sum.cer_r2",
        "null_random.ind.cer_r2",
        "glove.mean.cer_r2",
    ):
        for tag in ("", "_natural"):
            assert s[f"{key}{tag}_lo"] <= s[f"{key}{tag}"] <= s[f"{key}{tag}_hi"], key + tag
    assert s["minilm_L6.docs_over_context"] == 0
    assert (
        s["glove.word@center_zipf.verdict"] in (-1, 0, 1)
        and "minilm_L6.sum@whiten_zipf.null_random.spearman" in s
    )
    claims = json.loads((tiny_run / "claims.json").read_text())["claims"]
    names = {c["claim"]: c for c in claims}
    assert {"paper_word_correspondence", "paper_cls_fixed_point", "paper_eos_fixed_point",
            "control_ind_linearity_is_algebra"} <= set(names)  # fmt: skip
    assert names["paper_eos_fixed_point"]["verdict"] == "n/a"  # decoder disabled in this config
    assert names["paper_modernbert_cer"]["verdict"] == "n/a"  # no ModernBERT offline
    # IND over random word vectors is Σ‖rᵢ‖², linear in n by construction: this control must hold
    assert names["control_ind_linearity_is_algebra"]["verdict"] == "holds"
    assert s["claims.control_ind_linearity_is_algebra"] == 1


def test_report_and_resume(tiny_run):
    sections = report_sections(tiny_run)
    titles = [sec.title for sec in sections]
    assert any("Word level" in t for t in titles) and any("Constant entropy" in t for t in titles)
    for sec in sections:
        if sec.title.startswith(
            ("Word level", "Constant entropy")
        ):  # figure first, the full table folded below
            assert sec.figure is not None and sec.children[0].table and sec.children[0].collapsed, sec.title
        if sec.title.startswith(("Compositions", "Fixed point")):
            assert sec.table, sec.title
    assert "glove raw" in sections[0].text and "CER, minilm_L6" in sections[0].text
    assert "CER null (random word vectors" in sections[0].text
    surv = next(sec for sec in sections if sec.title.startswith("Which conclusions survive"))
    assert "**minilm_L6**" in surv.text and "explained by a null" in surv.text
    word = next(sec for sec in sections if sec.title.startswith("Word level")).children[0]
    assert {"rho random vectors", "rho piece count", "shuffled-IC 95%", "verdict"} <= set(word.table[0])
    before = json.loads((tiny_run / "summary.json").read_text())
    execute("normic-tiny", SMALL, out=tiny_run, resume=True, quiet=True)  # every stage is read back
    after = json.loads((tiny_run / "summary.json").read_text())
    assert {k: v for k, v in after.items() if k != "wall_time_s"} == {
        k: v for k, v in before.items() if k != "wall_time_s"
    }


@pytest.mark.slow
def test_full_normic_tiny_with_smollm2(tmp_path):
    """The shipped recipe as is (about 5 minutes on 2 cores): decoder keys, LM IC and EOS fixed point exist."""
    run_dir = execute("normic-tiny", [], out=tmp_path / "run", quiet=True)
    s = json.loads((run_dir / "summary.json").read_text())
    for key in (
        "smollm2_L30.pooled.spearman",
        "smollm2_input.sum.spearman",
        "smollm2_L30.cer_r2",
        "smollm2_L30.pooled.fixed_cos",
        "minilm_L6.pooled.fixed_cos",
        "glove.cer_r2",
    ):
        assert np.isfinite(s[key]), key
    assert (run_dir / "analysis" / "lm_ic.json").exists()
    # the shipped recipe: nulls on every decoder row, CER CIs over documents, claims evaluated
    for comp in ("sum", "ind", "joint"):
        assert s[f"smollm2_L30.{comp}.verdict"] in (-1, 0, 1)
        assert np.isfinite(s[f"smollm2_L30.{comp}.null_random.spearman"])
    assert s["smollm2_L30.pooled.fixed_cos_natural_lo"] <= s["smollm2_L30.pooled.fixed_cos_natural_hi"]
    assert s["smollm2_L30.docs_over_context"] == 0 and s["minilm_L6.docs_over_context"] == 0
    assert "claims.paper_eos_fixed_point" in s and "claims.paper_cls_fixed_point" in s


@pytest.fixture(scope="module")
def short_context_encoder(tmp_path_factory):
    """A tiny random BERT with MiniLM's WordPiece tokenizer and only 24 positions (22 pieces per text)."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    from reprlab.models.hf import _resolve

    path = tmp_path_factory.mktemp("tiny_bert")
    tok = AutoTokenizer.from_pretrained(_resolve("all-minilm-l6-v2")[0])
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=24)  # fmt: skip
    torch.manual_seed(0)
    BertModel(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_documents_longer_than_the_context_are_counted_not_hidden(short_context_encoder, tmp_path):
    """Length texts keep every piece the model accepts; prefixes beyond it are cut *and counted* per source."""
    over = [o for o in SMALL if not o.startswith(("length.n_words", "length.n_points"))]
    run_dir = execute("normic-tiny", [*over, f"encoder.model={short_context_encoder}", "encoder.name=tiny",
                                      "length.n_words=30", "length.n_points=6"], out=tmp_path / "run", quiet=True)  # fmt: skip
    s = json.loads((run_dir / "summary.json").read_text())
    ctx = json.loads((run_dir / "analysis" / "context.json").read_text())["tiny_L1"]
    assert ctx["limit"] == 22 and ctx["n_docs"] == 4  # 24 positions − [CLS] − [SEP]; 2 synthetic + 2 natural
    # 30 lower-case words are ≥ 30 WordPiece pieces > 22: every full document exceeds the context
    assert ctx["docs"] == 4 and s["tiny_L1.docs_over_context"] == 4 and ctx["max_pieces"] >= 30
    assert ctx["prefixes"] >= 4
    sec = next(x for x in report_sections(run_dir) if x.title.startswith("Documents longer"))
    assert sec.table[0]["over context"] == 4


def test_undefined_correlations_read_n_a_in_the_report_tables():
    """A constant norm (the CLS state at layer 0) has no rank correlation: the report says n/a, with no verdict
    mark, instead of 'nan (no)'; a normalisation that was not run is a dash, not a blank cell."""
    from reprlab.methods.norm_ic.report import _ci, normalization_table

    nan = float("nan")
    rows = [
        {"source": "m", "composition": "pooled", "normalization": "raw", "spearman": nan, "verdict": 0},
        {"source": "m", "composition": "sum", "normalization": "raw", "spearman": 0.5, "verdict": 1},
        {
            "source": "m",
            "composition": "sum",
            "normalization": "whiten_zipf",
            "spearman": -0.25,
            "verdict": -1,
        },
    ]
    table = normalization_table(rows)
    assert table == [
        {"source": "m", "composition": "pooled", "raw": "n/a", "whiten_zipf": "–"},
        {"source": "m", "composition": "sum", "raw": "0.500 (+)", "whiten_zipf": "-0.250 (−)"},
    ]
    assert _ci({"spearman": nan, "spearman_lo": nan, "spearman_hi": nan}, "spearman") == "n/a"
    assert (
        _ci({"spearman": 0.5, "spearman_lo": 0.4, "spearman_hi": 0.6}, "spearman") == "0.500 [0.400, 0.600]"
    )


def test_the_report_names_the_models_the_run_read_and_the_ones_it_switched_off(tmp_path):
    """The setup text follows the run's config: a demo with the decoder off does not describe a decoder it never
    read, a user's model is named as given, and the KL finding carries its sign against Oyama's positive R²."""
    import yaml

    from reprlab.methods.norm_ic.report import findings_text, models_text

    cfg = {"encoder": {"enabled": True, "model": "all-minilm-l6-v2", "name": "minilm"},
           "decoder": {"enabled": False, "model": "smollm2-135m-instruct", "name": "smollm2"}}  # fmt: skip
    (tmp_path / "config.yaml").write_text("# recipe: normic-tiny\n" + yaml.safe_dump(cfg))
    text = models_text(tmp_path)
    assert "encoder MiniLM-L6" in text and "Not run here: decoder SmolLM2" in text and "RMSNorm" not in text
    cfg["decoder"] = {"enabled": True, "model": "/data/my-llama", "name": "mine"}
    (tmp_path / "config.yaml").write_text("# recipe: normic-tiny\n" + yaml.safe_dump(cfg))
    text = models_text(tmp_path)
    assert "decoder /data/my-llama (mine)" in text and "Not run here" not in text and "RMSNorm" in text
    fit = {"r2": 0.2, "r2_lo": 0.1, "r2_hi": 0.3, "pearson": -0.45, "pearson_lo": -0.5, "pearson_hi": -0.4}
    line = findings_text([], {}, {"sgns": {"n": 9, "min_count": 5, "raw": fit}})
    assert "Pearson r = -0.450" in line and "runs the other way" in line
    line = findings_text([], {}, {"sgns": {"n": 9, "min_count": 5, "raw": {**fit, "pearson": 0.45}}})
    assert "runs the other way" not in line
