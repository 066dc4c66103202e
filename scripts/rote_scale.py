"""Reason to Rote across model size: claim pass rates and key numbers per size, from finished seed sweeps.

Each ``--size LABEL=DIR`` names a sweep folder of ``reprlab run rote-fda-tiny --seeds ... --out DIR`` (one run
folder per seed, ``DIR/seed-<s>/``). Every claim of the recipe is re-evaluated on every seed's
``summary.json`` (so claims added to the recipe after the runs are evaluated too); a claim whose keys a run
lacks is ``n/a`` there and not counted. Prints one Markdown table (pass rate per claim per size, then each
claim's numbers as mean [Student t 95 % interval] over seeds) and writes the plot of pass rate against the
number of parameters.

Usage: python scripts/rote_scale.py --size S=runs/scale/s --size M=runs/scale/m --size L=runs/scale/l
       [--recipe rote-fda-tiny] [--figure docs/figures/rote_fda_scale.png] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from reprlab.recipes import get_recipe
from reprlab.results.aggregate import expand_run_folders, read_seed_run, t_interval


def _params(cfg: dict) -> int:
    """Our GPT's parameter count from a run's config (FDA: 14 tokens, 16 positions)."""
    m = cfg["model"]
    d, dm, n = m["d_model"], m["d_mlp"], m["n_layers"]
    block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * dm + dm) + (dm * d + d)
    return 14 * d + 16 * d + n * block + 2 * d + 14 * d


def _fmt(values: list[float]) -> str:
    if not values:
        return "n/a"
    mean, _, lo, hi = t_interval(values)
    return f"{mean:.3f}" if lo is None else f"{mean:.3f} [{lo:.3f}, {hi:.3f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", action="append", required=True, help="LABEL=SWEEP_DIR, smallest first")
    ap.add_argument("--recipe", default="rote-fda-tiny", help="recipe whose claims are evaluated")
    ap.add_argument("--figure", default=None, help="PNG path for the pass-rate plot")
    ap.add_argument("--json", default=None, help="write the numbers as JSON here")
    args = ap.parse_args()
    claims = get_recipe(args.recipe).claims()
    sizes = []
    for spec in args.size:
        label, folder = spec.split("=", 1)
        folders = expand_run_folders([Path(folder)])
        # a sweep still running has seed folders without summary.json: tabulate the finished ones, say so
        unfinished = [p for p in folders if not (Path(p) / "summary.json").is_file()]
        if unfinished:
            print(f"{label}: {len(unfinished)} unfinished seed run(s) left out: {', '.join(map(str, unfinished))}",
                  file=sys.stderr)  # fmt: skip
        runs = [read_seed_run(p) for p in folders if p not in unfinished]
        if not runs:
            raise SystemExit(f"{folder}: no finished seed runs")
        m = runs[0].config["model"]
        row = {"label": label, "dir": folder, "seeds": [r.seed for r in runs], "params": _params(runs[0].config),
               "shape": f"{m['n_layers']} x {m['d_model']}", "claims": {}, "numbers": {}}  # fmt: skip
        for c in claims:
            verdicts = [c.evaluate(r.summary).holds for r in runs]
            measured = [v for v in verdicts if v is not None]
            row["claims"][c.name] = {"holds": sum(measured), "n": len(measured)}
            for key in c.keys:
                vals = [float(r.summary[key]) for r in runs if key in r.summary]
                row["numbers"][key] = [v for v in vals if math.isfinite(v)]
        for key in ("clean_test_em", "noisy_memorized", "steps", "train_seconds", "wall_time_s"):
            row["numbers"][key] = [float(r.summary[key]) for r in runs if key in r.summary]
        sizes.append(row)

    head = (
        "| claim | "
        + " | ".join(f"{s['label']} ({s['shape']}, {s['params'] / 1e6:.2f}M)" for s in sizes)
        + " |"
    )
    print(head)
    print("|---" * (len(sizes) + 1) + "|")
    for c in claims:
        cells = []
        for s in sizes:
            r = s["claims"][c.name]
            cells.append(f"{r['holds']}/{r['n']}" if r["n"] else "n/a")
        print(f"| {c.name} | " + " | ".join(cells) + " |")
    print()
    print("| quantity | " + " | ".join(s["label"] for s in sizes) + " |")
    print("|---" * (len(sizes) + 1) + "|")
    keys = list(dict.fromkeys(k for s in sizes for k in s["numbers"]))
    for key in keys:
        print(f"| {key} | " + " | ".join(_fmt(s["numbers"].get(key, [])) for s in sizes) + " |")

    if args.json:
        Path(args.json).write_text(json.dumps(sizes, indent=1))
    if args.figure:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7.5, 4.2))
        xs = [s["params"] for s in sizes]
        for i, c in enumerate(claims):
            pts = [(x, s["claims"][c.name]) for x, s in zip(xs, sizes) if s["claims"][c.name]["n"]]
            if not pts:
                continue
            jitter = 1 + 0.012 * (i - len(claims) / 2)  # claims that share a rate stay visible
            ax.plot(
                [x * jitter for x, _ in pts], [r["holds"] / r["n"] for _, r in pts], marker="o", label=c.name
            )
        ax.set_xscale("log")
        ax.set_xticks(xs, [f"{s['label']}\n{s['shape']}\n{s['params'] / 1e6:.2f}M" for s in sizes])
        ax.minorticks_off()
        ax.set_ylim(-0.05, 1.05)
        ax.set_ylabel("share of seeds where the claim holds")
        ax.set_title(
            "Reason to Rote claims on FDA vs model size ("
            + "/".join(str(len(s["seeds"])) for s in sizes)
            + " seeds)"
        )
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
        fig.tight_layout()
        Path(args.figure).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.figure, dpi=130)


if __name__ == "__main__":
    main()
