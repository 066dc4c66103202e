"""Where each model sits between stopping attacks and keeping benign behaviour: the trade-off plot.

A point is one model (stage 0, RR, CRL, CRL + mining; the base as the undefended end) at one setting: its
prefilling and embedding-attack ASR against its benign compliance, its over-refusal (XSTest-style safe prompts
refused) and the XSTest-style safe prompts it answers (neither refused nor degenerate: a model that turns safe
prompts into degenerate text keeps over-refusal low and still fails them). One run gives one point per model; a
seed sweep gives the mean with a Wilson interval over seeds (the aggregate's intervals for proportions); several
settings of a defence (a strength sweep: steps, loss weight) become one line per model through its settings,
labelled by setting (``scripts/crl_tradeoff.py``).

The shaded box of each panel is the target region of the recipe's claims [ours]: ASR at most 0.1, and benign
compliance and XSTest-style answers at least stage 0's minus 0.05 (over-refusal at most stage 0's plus 0.05).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from reprlab.errors import DataError
from reprlab.results.aggregate import aggregated_runs
from reprlab.results.intervals import interval
from reprlab.runs.atomic import read_json

MODELS = ("base", "refusal", "rr", "crl", "crl_adv")
LABELS = {"base": "base", "refusal": "stage 0", "rr": "RR", "crl": "CRL", "crl_adv": "CRL + mining"}
X_KEYS = ("benign_compliance", "over_refusal", "xstest_compliance")
OPTIONAL = ("xstest_compliance",)  # run folders from before the key have no such column
Y_KEYS = ("asr_prefill", "asr_embedding")
ASR_TARGET, TOLERANCE = 0.1, 0.05  # the thresholds of the recipe's claims [ours]


@dataclass(frozen=True)
class Value:
    """A mean with its interval (``lo``/``hi`` None for one run)."""

    mean: float
    lo: float | None = None
    hi: float | None = None


@dataclass(frozen=True)
class Point:
    """One model at one setting: ``values[key]`` for the keys of :data:`X_KEYS` and :data:`Y_KEYS` (an
    :data:`OPTIONAL` key is absent when some summary can give it neither stored nor derived)."""

    model: str
    setting: str
    values: Mapping[str, Value]
    n_seeds: int


def _get(s: Mapping[str, float], m: str, k: str) -> float | None:
    v = s.get(f"{m}.{k}")
    if isinstance(v, int | float):
        return float(v)
    if k == "xstest_compliance":  # summaries written before the key: the claims' own identity
        ref, deg = s.get(f"{m}.over_refusal"), s.get(f"{m}.xstest_degenerate")
        if isinstance(ref, int | float) and isinstance(deg, int | float):
            return 1.0 - float(ref) - float(deg)
    return None


def points_from_summaries(summaries: Sequence[Mapping[str, float]], setting: str = "") -> list[Point]:
    """Points of every model present in all ``summaries`` (one per seed of one setting).

    Intervals are the aggregate's for proportions (Wilson at the effective sample size over seeds); one summary gives
    bare means. ``xstest_compliance`` missing from a summary is ``1 - over_refusal - xstest_degenerate``.
    """
    if not summaries:
        raise DataError("trade-off: no run summaries to read")
    out = []
    for m in MODELS:
        got = {k: [_get(s, m, k) for s in summaries] for k in X_KEYS + Y_KEYS}
        if any(None in got[k] for k in X_KEYS + Y_KEYS if k not in OPTIONAL):
            continue
        vals = {}
        for k, xs in got.items():
            if None not in xs:
                iv = interval(xs, "proportion")
                vals[k] = Value(iv.mean, iv.lo, iv.hi)
        out.append(Point(m, setting, vals, len(summaries)))
    return out


def points_from_folder(folder: Path | str, setting: str = "") -> list[Point]:
    """Points of a run folder (``summary.json``), a sweep folder (``aggregate.json`` with its seeds' runs) or a
    folder of seed runs (``*/summary.json``)."""
    folder = Path(folder)
    if (folder / "aggregate.json").exists():
        runs = aggregated_runs(folder, read_json(folder / "aggregate.json"))
        missing = [str(p) for p in runs if not (p / "summary.json").exists()]
        if missing:
            raise DataError(f"trade-off: {folder}/aggregate.json names runs without summary.json: {missing}")
        return points_from_summaries([read_json(p / "summary.json") for p in runs], setting)
    if (folder / "summary.json").exists():
        return points_from_summaries([read_json(folder / "summary.json")], setting)
    # a sweep's seed folders (an aggregate folder beside them holds means, not a seed)
    seeds = sorted(p for p in folder.glob("*/summary.json") if not (p.parent / "aggregate.json").exists())
    if seeds:
        return points_from_summaries([read_json(p) for p in seeds], setting)
    raise DataError(
        f"trade-off: {folder} has no summary.json (a run), aggregate.json (a seed sweep) or */summary.json (seed runs)"
    )


def figure(points: Sequence[Point], plt, title: str = ""):
    """2 x 3 panels: ASR (prefill, embedding; rows) against benign compliance, over-refusal and XSTest-style
    answers (columns; 2 x 2 when no point has the last)."""
    xkeys = [k for k in X_KEYS if k not in OPTIONAL or any(k in p.values for p in points)]
    fig, axes = plt.subplots(2, len(xkeys), figsize=(5.25 * len(xkeys), 8.4), squeeze=False)
    colors = {m: f"C{i}" for i, m in enumerate(MODELS)}
    ref = [p for p in points if p.model == "refusal"]
    for r, yk in enumerate(Y_KEYS):
        for c, xk in enumerate(xkeys):
            ax = axes[r][c]
            if ref and all(xk in p.values for p in ref) and len({p.values[xk].mean for p in ref}) == 1:
                s0 = ref[0].values[xk].mean  # one stage 0: shade the claims' target region
                x0, x1 = (-0.02, s0 + TOLERANCE) if xk == "over_refusal" else (s0 - TOLERANCE, 1.02)
                ax.fill_between([x0, x1], -0.02, ASR_TARGET, color="green", alpha=0.12, lw=0,
                                label="target region [ours]")  # fmt: skip
            for m in MODELS:
                mine = [p for p in points if p.model == m and xk in p.values]
                if not mine:
                    continue
                if all(p.values == mine[0].values for p in mine):  # e.g. stage 0, shared by every setting
                    mine = [Point(m, "", mine[0].values, mine[0].n_seeds)]
                xs = [p.values[xk].mean for p in mine]
                ys = [p.values[yk].mean for p in mine]
                marker = "*" if m == "refusal" else "o"  # stage 0 on top: an untrained defence sits on it
                ax.plot(xs, ys, ("-" if len(mine) > 1 else "") + marker, color=colors[m], label=LABELS[m],
                        ms=11 if m == "refusal" else 6, zorder=3 if m == "refusal" else 2)  # fmt: skip
                for p in mine:
                    vx, vy = p.values[xk], p.values[yk]
                    if vx.lo is not None:
                        ax.errorbar(vx.mean, vy.mean, xerr=[[vx.mean - vx.lo], [vx.hi - vx.mean]],
                                    yerr=[[vy.mean - vy.lo], [vy.hi - vy.mean]], color=colors[m], alpha=0.35,
                                    capsize=2, lw=1)  # fmt: skip
                    if p.setting and len(mine) > 1:
                        ax.annotate(p.setting, (vx.mean, vy.mean), fontsize=7, xytext=(3, 3),
                                    textcoords="offset points")  # fmt: skip
            xlabel = "XSTest-style answered" if xk == "xstest_compliance" else xk.replace("_", " ")
            ax.set(xlim=(-0.02, 1.02), ylim=(-0.02, 1.02), xlabel=xlabel,
                   ylabel=f"ASR {yk.split('_')[1]}")  # fmt: skip
            if r == 0 and c == 0:
                ax.legend(fontsize=7, loc="upper left")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def table(points: Sequence[Point]) -> list[dict]:
    """One row per point: each key's mean and, over seeds, its interval."""
    rows = []
    settings = any(p.setting for p in points)  # a run's own points have none: no empty column
    for p in points:
        row = {"model": p.model, **({"setting": p.setting} if settings else {}), "seeds": p.n_seeds}
        for k in Y_KEYS + X_KEYS:
            v = p.values.get(k)
            if v is None:
                continue
            row[k] = v.mean
            if v.lo is not None:
                row[f"{k}.ci"] = f"[{v.lo:.2f}, {v.hi:.2f}]"
        rows.append(row)
    return rows
