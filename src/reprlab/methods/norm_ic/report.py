"""Report sections for Norm-IC runs, built only from ``analysis/*.json`` and ``summary.json`` in the run folder.

The Norm-IC paper's own numbers are unknown to us, so every comparison is against Oyama et al. (2023), the
Zipfian-whitening result files, or our own expectations ([ours], reasons in ``docs/norm_ic.md``), and says
which.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from reprlab.jsonfile import null_as_nan
from reprlab.report import Section
from reprlab.report.headline import Headline

REFERENCE_TEXT = (
    "Reference figures (the Norm-IC paper's own numbers are unknown): raw static norms against "
    "unigram IC are expected at r ≈ 0.3–0.65 [ours]; Oyama et al. (2023) report, for SGNS on text8 (17M "
    "tokens), R² ≈ 0.4 (r ≈ 0.63) against self-information and R² 0.831 against KL(w), their target, both "
    "positive (a larger norm, more information); the Zipfian-whitening result files give "
    "Pearson/Spearman 0.33/0.33 (raw) and 0.34/0.34 (Z-centred) for GloVe 840B on its top-500 words; "
    "contextual final-layer norms are expected weak; on synthetic text, mean pooling should flatten, the raw "
    "sum be convex and IND/INF/centred sums near-linear (r with n > 0.95) [ours]. Reasons: docs/norm_ic.md."
)
NULL_TEXT = (
    "Nulls [ours, docs/norm_ic.md]: (1) random vectors per piece — each subword id (static tables: each word) gets a "
    "fixed random vector carrying no information, composed exactly like the model's; (2) the piece count "
    "alone; (3) IC shuffled over words (95% permutation interval of ρ). A row survives when ρ lies outside "
    "the shuffled interval and the paired bootstrap CIs of ρ − ρ_random and ρ − ρ_count exclude 0, in the "
    "direction of ρ's sign. 'pooled' (CLS/EOS) has no random-piece analogue; one-piece sources have no count null. "
    "Beating the count is strict, so 'ρ | count' (partial Spearman given the piece count, bootstrap CI) says "
    "whether the norm still tracks IC among words with equal piece counts (next to what random pieces give there); "
    "it is shown, not part of the verdict."
)
COMPOSITIONS_TEXT = (
    "Compositions of a word's subword vectors: sum, mean, first, max; scaled_a/b/c, three readings [ours] of the "
    "paper's 'scaled embedding average' (√n·mean; the mean's direction at the norm of IND; the sum of vectors "
    "centred on a fitted mean); ICDS (Amigó et al. 2022) folded left to right: IND (independent: norms add), JOINT "
    "(minus the shared part), INF (scaled by the norms' ratio), icds_sum and icds_avg, *_rtl folded right to left; "
    "sif (Arora et al. 2017's frequency weights) and sif_pc (its first principal component removed); pooled, the "
    "model's own CLS/EOS state. Formulas: compose.py."
)
COLUMNS_TEXT = (
    "Raw norms. spearman / pearson: ρ and r of ‖v‖² with IC and their bootstrap CIs, beside the nulls' ρ (random "
    "pieces, piece count, shuffled IC) and the verdict. R2 and slope: the straight-line fit of ‖v‖² on IC. C1 dR2 "
    "quad: what a quadratic term adds to R² (0 = the relation is linear); C1 band rho: ρ between the Zipf "
    "frequency bands' mean IC and mean ‖v‖² (monotone on average); C2 r(dot,PMI): Pearson r of ⟨v_x, v_y⟩ with "
    "the PMI of co-occurring word pairs, over C2 pairs of them; anisotropy: ‖E v‖² / E‖v‖² over the fit words "
    "(0 = isotropic, 1 = every vector the same). C1 and C2 are our readings [ours] of the paper's "
    "conditions for the correspondence (docs/norm_ic.md)."
)
# the recipes' labels of their packaged models: (model, what it stands in for)
STAND_INS = {
    "minilm": ("all-minilm-l6-v2", "MiniLM-L6 (all-MiniLM-L6-v2), standing in for BERT"),
    "smollm2": (
        "smollm2-135m-instruct",
        "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised), standing in for LLaMA",
    ),
}


def models_text(run_dir: Path) -> str:
    """Which contextual models the run read (a demo may switch one off), what each stands in for, and how its
    'pooled' vector is made."""
    from reprlab.recipes import saved_config

    cfg = saved_config(run_dir)
    ran, off = [], []
    for role in ("encoder", "decoder"):
        part = cfg.get(role) or {}
        if not part:
            continue
        model = str(part.get("model", ""))
        what = next((d for m, d in STAND_INS.values() if m == model.lower()), f"{model} ({part.get('name')})")
        (ran if part.get("enabled", True) else off).append(f"{role} {what}")
    if not ran and not off:
        return ""
    text = "Contextual models: " + ("; ".join(ran) if ran else "none") + "."
    if off:
        text += " Not run here: " + "; ".join(off) + " (`enabled: false`)."
    text += " ModernBERT has no offline stand-in. 'pooled' is the CLS state (encoder), the state of an appended EOS"
    text += " token (decoder) or a sentence-transformers pipeline's own pooling (pooling=model)"
    text += (
        "; decoder last-layer states are read before the final RMSNorm."
        if any("decoder" in r for r in ran)
        else "."
    )
    return text


def pooling_text(run_dir: Path) -> str:
    """One line per model: how its 'pooled' vector was made (summary key ``<model>.pooling``)."""
    summary = _load(run_dir, "summary.json") or {}
    lines = [f"Pooling of {k.rsplit('.', 1)[0]}: {v}." for k, v in summary.items() if k.endswith(".pooling")]
    return " ".join(lines)


def _load(run_dir: Path, rel: str):
    path = run_dir / rel
    if not path.exists():
        return None
    try:
        return null_as_nan(json.loads(path.read_text()))  # NaN statistics are written as null
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is corrupt: {err}") from err


def _num(v, spec: str = ".3f") -> str:
    """``v`` formatted, or "n/a" where it is undefined (a constant norm has no rank correlation)."""
    return format(v, spec) if v is not None and np.isfinite(v) else "n/a"


def _ci(row: dict, stat: str) -> str:
    if not np.isfinite(row[stat]):
        return "n/a"
    return f"{row[stat]:.3f} [{row[stat + '_lo']:.3f}, {row[stat + '_hi']:.3f}]"


VERDICT = {1: "survives (+)", -1: "survives (−)", 0: "does not survive"}


def _verdict_text(r: dict) -> str:
    """A row's verdict against the nulls; n/a where its norms are constant (no ρ to test)."""
    if r.get("failed") == "undefined":
        return "n/a (constant norms: no correlation)"
    return VERDICT[r["verdict"]] + (f" ({r['failed']})" if r["failed"] else "")


def _nulls(r: dict) -> dict:
    """The null columns of one raw row (empty when the run had no nulls)."""
    if "verdict" not in r:
        return {}
    f = lambda v: "n/a" if v is None or not np.isfinite(v) else f"{v:.3f}"  # noqa: E731
    return {"rho random vectors": f(r["null_random"]),
            "rho piece count": f(r.get("piece_count_spearman")),
            "shuffled-IC 95%": f"[{r['null_shuffle_lo']:.3f}, {r['null_shuffle_hi']:.3f}]",
            "rho - random [CI]": "n/a" if not np.isfinite(r["null_random_diff_lo"]) else
            f"{r['spearman'] - r['null_random']:.3f} [{r['null_random_diff_lo']:.3f}, {r['null_random_diff_hi']:.3f}]",
            "rho | count [CI]": "n/a" if not np.isfinite(r.get("null_count_partial", np.nan)) else
            f"{r['null_count_partial']:.3f} [{r['null_count_partial_lo']:.3f}, {r['null_count_partial_hi']:.3f}]",
            "rho | count, random pieces": f(r.get("null_random_partial")),
            "verdict": _verdict_text(r)}  # fmt: skip


def correlation_table(rows: list[dict]) -> list[dict]:
    """Raw-norm rows: source × composition with Spearman/Pearson and their CIs, the nulls and the verdict,
    R², C1/C2 diagnostics."""
    out = []
    for r in rows:
        if r["normalization"] != "raw":
            continue
        out.append({"source": r["source"], "composition": r["composition"], "n": r["n"],
                    "spearman [CI]": _ci(r, "spearman"), **_nulls(r), "pearson [CI]": _ci(r, "pearson"), "R2": r["r2"],
                    "slope": r["slope"], "C1 dR2 quad": r.get("c1_delta_r2_quadratic"),
                    "C1 band rho": r.get("c1_band_spearman"), "C2 r(dot,PMI)": r.get("c2_pearson"),
                    "C2 pairs": r.get("c2_pairs"), "anisotropy": r.get("anisotropy")})  # fmt: skip
    return out


def _partial(r: dict) -> str:
    """'; ρ|count = … [CI]' when the row loses to the piece count yet carries IC within equal counts."""
    lo, hi = r.get("null_count_partial_lo", np.nan), r.get("null_count_partial_hi", np.nan)
    rand = r.get("null_random_partial", np.nan)
    floor = rand if np.isfinite(rand) else 0.0  # beyond what random pieces give within equal counts
    same_side = lo > max(floor, 0) if r["spearman"] > 0 else hi < min(floor, 0)
    if "piece count" not in r["failed"] or not np.isfinite(lo) or not same_side:
        return ""  # not a count failure, no count, or no IC left within equal counts beyond random pieces
    ref = f", random pieces {rand:+.2f}" if np.isfinite(rand) else ""
    return f"; but ρ | count = {r['null_count_partial']:+.2f} [{lo:+.2f}, {hi:+.2f}]{ref}"


def survival_text(rows: list[dict]) -> str:
    """Which word-level conclusions survive the null baselines, source by source."""
    raw = [r for r in rows if r["normalization"] == "raw" and "verdict" in r]
    if not raw:
        return "This run had no null baselines (analysis.nulls=false)."
    lines = []
    for src in dict.fromkeys(r["source"] for r in raw):
        rs = [r for r in raw if r["source"] == src]
        pos = [r["composition"] for r in rs if r["verdict"] == 1]
        neg = [r["composition"] for r in rs if r["verdict"] == -1]
        gone = [f"{r['composition']} (ρ {_num(r['spearman'], '+.2f')}; {r['failed']}{_partial(r)})" for r in rs
                if r["verdict"] == 0 and r.get("failed") != "undefined"]  # fmt: skip
        flat = [r["composition"] for r in rs if r.get("failed") == "undefined"]
        pc = rs[0].get("piece_count_spearman")
        pc_txt = (
            f"piece count alone ρ = {pc:+.2f}" if pc is not None and np.isfinite(pc) else "one piece per word"
        )
        lines.append(f"- **{src}** ({pc_txt}): positive correspondence beyond every null: "
                     f"{', '.join(pos) or 'none'}; negative beyond every null: {', '.join(neg) or 'none'}; "
                     f"explained by a null: {'; '.join(gone) or 'none'}"
                     + (f"; constant norms, no correlation to test: {', '.join(flat)}" if flat else "") + ".")  # fmt: skip
    return "\n".join(lines)


def composition_ranking(rows: list[dict]) -> list[dict]:
    """Mean raw Spearman of each composition over the subword sources (static tables have only 'word'), with
    the mean excess over the random-vector null and how many sources survive every null (positive ρ)."""
    by: dict[str, list[dict]] = {}
    for r in rows:
        # NaN: constant norms, e.g. the CLS/EOS state at layer 0, which no word can influence
        if r["normalization"] == "raw" and r["composition"] != "word" and np.isfinite(r["spearman"]):
            by.setdefault(r["composition"], []).append(r)
    table = []
    for c, rs in by.items():
        v = [r["spearman"] for r in rs]
        row = {"composition": c, "mean spearman": float(np.mean(v)), "min": float(np.min(v)),
               "max": float(np.max(v)), "sources": len(v)}  # fmt: skip
        if all("verdict" in r for r in rs):
            ex = [r["spearman"] - r["null_random"] for r in rs if np.isfinite(r["null_random"])]
            row["mean rho - random"] = float(np.mean(ex)) if ex else float("nan")
            row["sources surviving (+)"] = sum(r["verdict"] == 1 for r in rs)
        table.append(row)
    return sorted(table, key=lambda t: -t["mean spearman"])


def normalization_table(rows: list[dict]) -> list[dict]:
    """Spearman per normalisation for each source's compositions 'word', 'sum', 'sif' and 'pooled', each with
    its verdict against the nulls (the random-piece null normalised the same way): (+)/(−) survives, (no) not."""
    keep = {"word", "sum", "sif", "pooled"}
    mark = {1: " (+)", -1: " (−)", 0: " (no)"}
    table: dict[tuple, dict] = {}
    for r in rows:
        if r["composition"] in keep:
            defined = np.isfinite(r["spearman"])
            cell = _num(r["spearman"]) + (mark[r["verdict"]] if "verdict" in r and defined else "")
            table.setdefault((r["source"], r["composition"]), {"source": r["source"], "composition": r["composition"]})[
                r["normalization"]] = cell  # fmt: skip
    cols = list(dict.fromkeys(k for row in table.values() for k in row))
    return [{k: row.get(k, "–") for k in cols} for row in table.values()]  # a normalisation not run: a dash


def scatter_figure(scatter: dict, rows: list[dict]):
    """One panel per source: ‖v‖² against IC for its best raw composition, with a LOWESS curve.

    The cloud often saturates or bends (rare words under-trained), so a straight least-squares line would
    misdescribe it; the LOWESS curve (local linear fits to 30% of the words, tricube weights) follows it.
    """
    from reprlab.report.figures import lowess, pyplot

    panels = []
    for model in scatter.values():
        for src, comps in model["sq"].items():
            cand = [
                r
                for r in rows
                if r["source"] == src and r["normalization"] == "raw" and np.isfinite(r["spearman"])
            ]
            if not cand:
                continue
            best = max(cand, key=lambda r: r["spearman"])
            panels.append(
                (
                    src,
                    best,
                    np.array(model["ic"], dtype=float),
                    np.array(comps[best["composition"]], dtype=float),
                )
            )
    if not panels:
        return None
    plt = pyplot()
    cols = min(3, len(panels))
    nrows = int(np.ceil(len(panels) / cols))
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 4.2 * nrows), squeeze=False)
    for ax, (src, best, ic, sq) in zip(axes.flat, panels):
        ax.scatter(ic, sq, s=5, alpha=0.35, color="0.4", label="one word", rasterized=True)
        grid, curve = lowess(ic, sq, frac=0.3)
        ax.plot(grid, curve, color="C3", lw=2.2, label="LOWESS (frac 0.3)")
        ax.set_title(f"{src} / {best['composition']}: ρ = {best['spearman']:.2f}, r = {best['pearson']:.2f}")
        ax.set_xlabel("information content −ln p(w) (nats)")
        ax.set_ylabel("squared norm ‖v‖²")
    axes.flat[0].legend(loc="best")
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.tight_layout()
    return fig


def band_table(scatter: dict, rows: list[dict]) -> list[dict]:
    """Within-band Spearman and mean ‖v‖² per Zipf band (0 = most frequent) for each source's best composition.

    A correlation that is positive inside bands but negative overall (or the reverse) signals a non-monotone
    norm–frequency curve, e.g. under-trained rare words with short norms (Oyama et al. 2023, App. G).
    """
    from reprlab.methods.norm_ic.stats import spearman

    out = []
    for model in scatter.values():
        if "band" not in model:
            return []
        ic, band = np.array(model["ic"]), np.array(model["band"])
        for src, comps in model["sq"].items():
            best = max((r for r in rows if r["source"] == src and r["normalization"] == "raw"),
                       key=lambda r: r["spearman"])  # fmt: skip
            sq = np.array(comps[best["composition"]])
            row = {"source": src, "composition": best["composition"]}
            for b in np.unique(band):
                m = band == b
                rho = spearman(ic[m], sq[m]) if m.sum() > 5 else float("nan")
                row[f"b{b} rho / mean"] = f"{_num(rho, '.2f')} / {sq[m].mean():.3g}"
            out.append(row)
    return out


def _ci_opt(st: dict, stat: str) -> str:
    """``mean [lo, hi]`` when the run has bootstrap bounds over documents, else the mean alone."""
    if stat + "_lo" not in st:
        return f"{st[stat]:.3f}"
    return f"{st[stat]:.3f} [{st[stat + '_lo']:.3f}, {st[stat + '_hi']:.3f}]"


def length_table(length: dict) -> list[dict]:
    out = []
    for src, kinds in length.items():
        for kind, comps in kinds.items():
            for comp, st in comps.items():
                row = {"source": src, "texts": kind, "composition": comp, "docs": st.get("n_docs"),
                       "R2 vs n [CI]": _ci_opt(st, "r2_len"),
                       "R2 vs unigram IC": st["r2_ic"], "monotone rho": st["monotone_spearman"],
                       "curvature": st["curvature"], "half-slope ratio": st["half_slope_ratio"],
                       "cos(v_n, v_N) 2nd half [CI]": _ci_opt(st, "cos_to_final_2nd_half"),
                       "norm2 growth 2nd half": st["norm_growth_2nd_half"]}  # fmt: skip
                if "r2_lm_ic" in st:
                    row["R2 vs LM IC"] = st["r2_lm_ic"]
                out.append(row)
    return out


def length_figure(length: dict, kind: str = "synthetic"):
    """Mean normalised ‖v_n‖²/‖v_N‖² against prefix length n, one panel per source."""
    from reprlab.report.figures import pyplot

    srcs = [s for s in length if kind in length[s]]
    if not srcs:
        return None
    plt = pyplot()
    cols = min(3, len(srcs))
    nrows = int(np.ceil(len(srcs) / cols))
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 4.0 * nrows), squeeze=False)
    for ax, src in zip(axes.flat, srcs):
        for i, (comp, st) in enumerate(length[src][kind].items()):
            ax.plot(
                st["grid"], st["curve"], label=comp, color=f"C{i % 10}", ls="-" if i < 10 else "--", lw=1.6
            )
        ax.plot([0, st["grid"][-1]], [0, 1], color="k", lw=1.0, ls=":", label="proportional to n")
        ax.set_title(f"{src} ({kind} texts)")
        ax.set_xlabel("prefix length n (words)")
        ax.set_ylabel("‖v_n‖² / ‖v_N‖²")
    for ax in list(axes.flat)[len(srcs) :]:
        ax.axis("off")
    legend: dict[str, object] = {}  # every composition drawn in any panel, once
    for ax in axes.flat:
        for h, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, h)
    handles, labels = list(legend.values()), list(legend)
    fig.legend(handles, labels, loc="lower center", ncol=min(7, len(labels)), bbox_to_anchor=(0.5, -0.02),
               frameon=False)  # fmt: skip
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


def findings_text(rows: list[dict], length: dict, oyama: dict | None) -> str:
    """Headline findings, each set against its reference figure (agreeing or not)."""
    lines = []
    for r in rows:
        if r["composition"] == "word" and r["normalization"] == "raw":
            inside = "inside" if 0.3 <= r["pearson"] <= 0.65 else "outside"
            null = f"; against the nulls: {_verdict_text(r)}" if "verdict" in r else ""
            lines.append(f"- {r['source']} raw ‖v‖² vs IC: Pearson {_ci(r, 'pearson')}, Spearman {_ci(r, 'spearman')} "
                         f"(n={r['n']}); {inside} our expected r ≈ 0.3–0.65 [ours]{null}.")  # fmt: skip
    for name, o in (oyama or {}).items():
        for tag in ("raw", "centred"):
            if tag in o:
                f = o[tag]
                sign = ("" if "pearson" not in f or f["pearson"] >= 0
                        else "; the relation runs the other way: a larger norm, a smaller KL")  # fmt: skip
                pearson = (f"Pearson r = {f['pearson']:+.3f} [{f['pearson_lo']:+.3f}, {f['pearson_hi']:+.3f}], "
                           if "pearson" in f else "")  # fmt: skip
                lines.append(f"- {name} ‖u{'−ū' if tag == 'centred' else ''}‖² vs KL(w) (Oyama's target, n={o['n']}, "
                             f"n_w ≥ {o['min_count']}): {pearson}R² = {f['r2']:.3f} [{f['r2_lo']:.3f}, "
                             f"{f['r2_hi']:.3f}] vs Oyama's positive 0.831 on 17M tokens{sign}.")  # fmt: skip
    ranking = composition_ranking(rows)
    if ranking:
        top = ", ".join(f"{t['composition']} ({t['mean spearman']:.2f})" for t in ranking[:4])
        low = ", ".join(f"{t['composition']} ({t['mean spearman']:.2f})" for t in ranking[-3:])
        lines.append(f"- Compositions, mean Spearman over subword sources: best {top}; worst {low}.")
    raw = [r for r in rows if r["normalization"] == "raw" and "verdict" in r and r["composition"] != "word"]
    if raw:
        ok = sum(r["verdict"] == 1 for r in raw)
        lines.append(f"- Null baselines: {ok} of {len(raw)} (subword source × composition) rows keep a positive "
                     "correspondence beyond random vectors per piece, the piece count and shuffled IC; the rest "
                     "are listed under 'Which conclusions survive the null baselines'.")  # fmt: skip
    null = length.get("null_random", {}).get("synthetic", {})
    for src, kinds in length.items():
        syn = kinds.get("synthetic", {})
        if not syn or src == "null_random":
            continue
        linear = [c for c, st in syn.items() if st["pearson_len"] > 0.95]
        lines.append(f"- CER, {src} (synthetic): r(n, ‖v_n‖²) > 0.95 for {', '.join(linear) or 'none'}; "
                     + "; ".join(f"{c}: R²={syn[c]['r2_len']:.2f}, curvature={syn[c]['curvature']:.2f}, "
                                 f"cos(v_n,v_N)={syn[c]['cos_to_final_2nd_half']:.3f}"
                                 for c in ("mean", "sum", "ind", "pooled") if c in syn) + ".")  # fmt: skip
    if null:
        lines.append(
            "- CER null (random word vectors, no information): "
            + "; ".join(
                f"{c}: R²={null[c]['r2_len']:.2f}, cos(v_n,v_N)={null[c]['cos_to_final_2nd_half']:.3f}"
                for c in ("mean", "sum", "ind")
                if c in null
            )
            + ". A source's CER shape means something only where "
            "it departs from these: a mean-pooling fixed point and a linear IND are algebra, not the model."
        )
    lines.append(
        "- Our expectation [ours]: mean flattens (fixed point), raw sum convex, IND/INF/centred sums "
        "near-linear (r > 0.95); the paper: BERT CLS and LLaMA EOS converge towards a fixed point."
    )
    return "\n".join(lines)


def fixed_point_table(length: dict) -> list[dict]:
    """CLS/EOS ('pooled') and mean pooling: direction and norm convergence over the second half of the prefixes."""
    out = []
    for src, kinds in length.items():
        for kind, comps in kinds.items():
            for comp in ("pooled", "mean"):
                if comp in comps:
                    st = comps[comp]
                    out.append({"source": src, "texts": kind, "composition": comp, "docs": st.get("n_docs"),
                                "cos(v_n, v_N) 2nd half [CI]": _ci_opt(st, "cos_to_final_2nd_half"),
                                "sd": st["cos_to_final_2nd_half_sd"],
                                "norm2 growth 2nd half": st["norm_growth_2nd_half"],
                                "half-slope ratio": st["half_slope_ratio"], "R2 vs n": st["r2_len"]})  # fmt: skip
    return out


def build_sections(run_dir: Path) -> list[Section]:
    words = _load(run_dir, "analysis/words.json")
    if words is None:
        return [Section("Norm-IC", f"no analysis/words.json in {run_dir}: the run did not finish")]
    rows = words["rows"]
    scatter = _load(run_dir, "analysis/scatter.json") or {}
    length = _load(run_dir, "analysis/length.json") or {}
    oyama = _load(run_dir, "analysis/oyama_kl.json")
    context = _load(run_dir, "analysis/context.json") or {}
    sections = [
        Section("Findings against the reference figures", findings_text(rows, length, oyama)),
        Section("Setup and reference figures", f"{words['n_eval']} evaluation words stratified over wordfreq Zipf bands; "
                f"{words['n_fit']} disjoint fit words for centring, whitening, μ (scaled_c) and the SIF PC. "
                f"IC = −log p(w) from wordfreq in {words['unit']}. CIs: percentile bootstrap over words. "
                + models_text(run_dir) + " " + pooling_text(run_dir) + "\n\n" + REFERENCE_TEXT),  # fmt: skip
        Section("Word level: ‖v‖² against IC (raw norms)",
                "Each source's best raw composition; every word a dot; the red curve is a LOWESS smoother "
                "(local linear fits to 30% of the words), not a straight-line fit, since the cloud bends.",
                figure=scatter_figure(scatter, rows),
                children=[Section("Every source × composition with its nulls", COLUMNS_TEXT,
                                  table=correlation_table(rows), collapsed=True)]),
        Section("Which conclusions survive the null baselines", NULL_TEXT + "\n\n" + survival_text(rows)),
        Section("Compositions ranked by how well they preserve the correspondence",
                "Mean Spearman over the subword sources (input tables and layers); higher is better. Caveat "
                "[ours]: SIF weights are a/(a + p), a function of frequency itself, so part of SIF's "
                "correspondence is built in rather than found in the embedding; 'pooled' is the model's "
                "CLS/EOS state, not a composition of the subwords. " + COMPOSITIONS_TEXT,
                table=composition_ranking(rows)),
        Section("Normalisations (fitted on the disjoint fit vocabulary)",
                "Spearman ρ of ‖v‖² with IC after centring/whitening; uniform vs Zipf-weighted. In brackets the "
                "verdict against the nulls, the random-piece null centred/whitened the same way on its own fit "
                "set: (+)/(−) survives with that sign, (no) explained by a null (words.json names which).",
                table=normalization_table(rows), collapsed=True),
        Section("Frequency bands", "Within-band Spearman ρ and mean ‖v‖² (ρ / mean) for each Zipf band, "
                "most frequent first, for each source's best raw composition.", table=band_table(scatter, rows),
                collapsed=True),
        Section("IC sources", "Spearman of each source's best raw composition against wordfreq IC, "
                "corpus-count IC (add-k) and, when a decoder ran, its own surprisal of the word after one context "
                "token; the shuffled-IC interval is chance level at this n.",
                table=words.get("ic_sources"), collapsed=True),
    ]  # fmt: skip
    if length:
        sections.append(Section(
            "Constant entropy rate: ‖v_n‖² over prefixes of growing length",
            "Synthetic texts are i.i.d. unigram draws (IC exactly additive, so linear in n in expectation); "
            "natural texts are packaged documents (Wikipedia slice by default) restricted to known words. "
            "Statistics are means over documents with 95% percentile-bootstrap CIs over documents; source "
            "'null_random' composes random word vectors (the null). Curves are means over documents of "
            "‖v_n‖²/‖v_N‖²; the dotted line is exact proportionality.",
            figure=length_figure(length, "synthetic"),
            children=[Section("Every source × composition", table=length_table(length), collapsed=True)]))  # fmt: skip
        sections.append(Section(
            "Fixed point of CLS/EOS and mean pooling",
            "cos(v_n, v_N) averaged over the second half of the prefix grid (1 = the direction has stopped "
            "moving) and the relative growth of ‖v‖² over that half (0 = the norm has stopped growing). The "
            "mean-pooling fixed point is a property of averaging [ours, docs/norm_ic.md], shown as the control.",
            table=fixed_point_table(length), figure=length_figure(length, "natural")))  # fmt: skip
    if context:
        sections.append(Section(
            "Documents longer than the model's context",
            "Length-experiment texts keep every piece the model accepts; a prefix longer than the context is cut "
            "to it (with a warning), which would flatten its curve artificially. Counts per source:",
            table=[{"source": s, "documents": c["n_docs"], "over context": c["docs"], "prefixes cut": c["prefixes"],
                    "context (pieces)": c["limit"], "longest text (pieces)": c["max_pieces"]}
                   for s, c in context.items()], collapsed=True))  # fmt: skip
    return sections


def headline(summary: dict) -> list[Headline]:
    """The curated headline: word-level correspondence of the static tables and each model's last layer
    (IND, sum, mean, pooled) against the nulls, and the length experiment's shape for the same rows."""
    srcs = list(dict.fromkeys(k.split(".")[0] for k in summary
                              if k.endswith(".spearman") and k.count(".") == 2 and "@" not in k))  # fmt: skip
    last: dict[str, tuple[int, str]] = {}
    for src in srcs:
        m = re.fullmatch(r"(.+)_L(\d+)", src)
        if m and int(m.group(2)) > last.get(m.group(1), (-1, ""))[0]:
            last[m.group(1)] = (int(m.group(2)), src)
    comps = ("ind", "sum", "mean", "pooled")
    rows = [(f"{s} / word", f"{s}.word") for s in srcs if f"{s}.word.spearman" in summary]
    rows += [
        (f"{s} / {c}", f"{s}.{c}") for _, s in last.values() for c in comps if f"{s}.{c}.spearman" in summary
    ]
    word = Headline(tuple(rows), cols=(("Spearman ρ [95% CI]", "spearman"), ("Pearson r [95% CI]", "pearson"),
                                       ("ρ of random vectors per piece", "null_random.spearman"),
                                       ("against the nulls", "verdict")),
                    pattern="{row}.{col}", corner="source / composition",
                    caption="Word level: squared norm against information content (raw norms)",
                    labels={"verdict": {1: "survives (+)", -1: "survives (−)", 0: "explained by a null"}})  # fmt: skip
    cer_rows = [(f"{s} / {c}", f"{s}.{c}") for s in [v[1] for v in last.values()] + ["null_random"] for c in comps
                if f"{s}.{c}.cer_r2" in summary or f"{s}.{c}.fixed_cos_natural" in summary]  # fmt: skip
    cer = Headline(tuple(cer_rows), cols=(("R² against length n, synthetic [CI]", "cer_r2"),
                                          ("R² against n, natural [CI]", "cer_r2_natural"),
                                          ("cos(v_n, v_N), natural [CI]", "fixed_cos_natural")),
                   pattern="{row}.{col}", corner="source / composition",
                   caption="Length: ‖v_n‖² over growing prefixes (null_random: random word vectors)")  # fmt: skip
    return [word, cer]
