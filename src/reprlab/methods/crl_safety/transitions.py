"""What a defence did to each prompt, read against stage 0's label of the same prompt [ours].

Every model of a CRL run answers the same evaluation prompts, so the pair (stage 0's label, the defence's label) of
each prompt says where a benign-compliance loss comes from: answers lost to refusals or to degenerate text, or
stage 0's own refusals answered (docs/crl_safety.md, "Where the forward benign losses come from").
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from reprlab.errors import RunFolderError
from reprlab.jsonfile import read_stage

LABELS = ("comply", "refuse", "degenerate")


def label_pairs(run_dirs, model: str = "crl_adv", base: str = "refusal", split: str = "benign") -> Counter:
    """``Counter`` of ``(base label, model label)`` over the prompts of ``split`` ('benign', 'xstest', 'direct')
    in every run folder of ``run_dirs`` (seeds add up), from ``stages/eval_<model>.json`` and
    ``stages/eval_<base>.json``. The two must have judged the same prompts."""
    out: Counter = Counter()
    for run_dir in map(Path, run_dirs):
        got = {}
        for name in (base, model):
            path = run_dir / "stages" / f"eval_{name}.json"
            if not path.exists():
                raise RunFolderError(f"{path} is missing: was {name!r} evaluated in this run (models=[...])?")
            got[name] = read_stage(path)
        a, b = got[base], got[model]
        if split not in a or split not in b:
            raise RunFolderError(
                f"{run_dir}: no {split!r} generations in the evaluation of {base} and {model}"
            )
        if a["prompts"].get(split) != b["prompts"].get(split):
            raise RunFolderError(f"{run_dir}: {base} and {model} were judged on different {split} prompts")
        out.update(zip(a[split]["labels"], b[split]["labels"]))
    return out


def count(pairs: Counter, base_label: str) -> int:
    """How many prompts stage 0 gave ``base_label``."""
    return sum(v for (a, _), v in pairs.items() if a == base_label)


def shares(pairs: Counter, base_label: str) -> dict[str, float]:
    """Of the prompts stage 0 gave ``base_label``, the share the defence gave each label (NaN-free: {} if none)."""
    n = count(pairs, base_label)
    return {} if n == 0 else {lab: pairs[(base_label, lab)] / n for lab in LABELS}
