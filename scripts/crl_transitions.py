"""Stage 0's label against a defence's, prompt by prompt, over the seed runs of one or more settings.

Usage: python scripts/crl_transitions.py --arm recipe=runs/fwd --arm "KL only=runs/arm8" [--model crl_adv]
       [--split benign]

Each ``--arm LABEL=DIR`` names a folder of seed runs (``DIR/seed-<s>/``) or one run folder. Prints one Markdown
row per arm: of the prompts stage 0 answered, the shares the defence turned degenerate / refused; of those stage 0
refused, the shares it answered / turned degenerate / kept refused.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from reprlab.errors import ReprlabError
from reprlab.methods.crl_safety.transitions import count, label_pairs, shares


def _runs(folder: Path) -> list[Path]:
    seeds = sorted(p for p in folder.glob("seed-*") if p.is_dir())
    return seeds or [folder]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arm", action="append", required=True, help="LABEL=DIR (repeatable)")
    ap.add_argument("--model", default="crl_adv")
    ap.add_argument("--split", default="benign")
    args = ap.parse_args(argv)
    print(
        "| arm | stage 0 answered (n): degenerate / refused | stage 0 refused (n): answered / degenerate / refused |"
    )
    print("|---|---|---|")
    try:
        for spec in args.arm:
            label, _, folder = spec.partition("=")
            pairs = label_pairs(_runs(Path(folder)), model=args.model, split=args.split)
            c, r = shares(pairs, "comply"), shares(pairs, "refuse")
            nc, nr = count(pairs, "comply"), count(pairs, "refuse")
            left = f"({nc}) {c['degenerate']:.2f} / {c['refuse']:.2f}" if c else "–"
            right = f"({nr}) {r['comply']:.2f} / {r['degenerate']:.2f} / {r['refuse']:.2f}" if r else "–"
            print(f"| {label} | {left} | {right} |")
    except ReprlabError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
