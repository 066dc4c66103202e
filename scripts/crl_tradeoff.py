"""CRL's trade-off across settings: ASR against benign compliance, over-refusal and XSTest-style answers, one line
per model.

Each ``--point LABEL=DIR`` is one setting of a strength sweep (e.g. ``defense.optim.steps=8``) and names a run
folder, a sweep folder (``aggregate.json``) or a folder of seed runs (``DIR/seed-<s>/summary.json``). Every model of
every setting becomes a point (mean over seeds with its Wilson interval); a model's points are joined in the order
given. Prints one Markdown table and writes the plot.

Usage: python scripts/crl_tradeoff.py --point 8=runs/steps8 --point 16=runs/steps16 --point 32=runs/crl3 \\
       [--models refusal,rr,crl,crl_adv] [--title "crl-tiny, defence steps"] [--figure docs/figures/crl_tradeoff.png]
"""

from __future__ import annotations

import argparse
import sys

from reprlab.errors import ReprlabError
from reprlab.methods.crl_safety import tradeoff
from reprlab.report.figures import pyplot

HEAD = {"xstest_compliance": "XSTest answered"}


def _cell(v: tradeoff.Value | None) -> str:
    if v is None:  # a run folder from before the key, without the shares to derive it
        return "–"
    return f"{v.mean:.2f}" if v.lo is None else f"{v.mean:.2f} [{v.lo:.2f}, {v.hi:.2f}]"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--point", action="append", required=True, metavar="LABEL=DIR")
    ap.add_argument("--models", default="refusal,rr,crl,crl_adv")
    ap.add_argument("--title", default="")
    ap.add_argument("--figure", default="")
    a = ap.parse_args(argv)
    models = a.models.split(",")
    bad = [m for m in models if m not in tradeoff.MODELS]
    if bad:
        ap.error(f"unknown models {bad}; choose from {list(tradeoff.MODELS)}")
    pts = []
    try:
        for spec in a.point:
            label, sep, folder = spec.partition("=")
            if not sep or not folder:
                ap.error(f"--point takes LABEL=DIR, got {spec!r}")
            pts += [p for p in tradeoff.points_from_folder(folder, label) if p.model in models]
    except ReprlabError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    keys = tradeoff.Y_KEYS + tradeoff.X_KEYS
    print("| model | setting | seeds | " + " | ".join(HEAD.get(k, k.replace("_", " ")) for k in keys) + " |")
    print("|---|---|---|" + "---|" * len(keys))
    for p in sorted(pts, key=lambda p: models.index(p.model)):
        cells = " | ".join(_cell(p.values.get(k)) for k in keys)
        print(f"| {tradeoff.LABELS[p.model]} | {p.setting} | {p.n_seeds} | {cells} |")
    if a.figure:
        tradeoff.figure(pts, pyplot(), a.title).savefig(a.figure, dpi=110, bbox_inches="tight")
        print(f"figure: {a.figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
