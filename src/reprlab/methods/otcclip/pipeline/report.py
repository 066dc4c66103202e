"""The run report's OTCCLIP sections (the recipe's ``report_sections``), built from the files a run saved only:
``analysis/results.json``, ``analysis/data.json``, ``metrics.jsonl``, ``analysis/audit.json`` and the
re-assigned-caption examples.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from reprlab.jsonfile import null_as_nan
from reprlab.methods.otcclip.data.pairs import BACKDOOR, TARGETED
from reprlab.report import Section
from reprlab.report.headline import Headline
from reprlab.report.render import fmt

# shares of test items or pairs: Wilson intervals over seeds (reprlab.results.intervals)
SUMMARY_KINDS = {"*.zeroshot_acc": "proportion", "*.linear_probe_acc": "proportion", "*.asr_*": "proportion",
                 "*.rematch_*": "proportion", "*.flag_*": "proportion", "*.ot_converged_share": "proportion", "*.nn_concept_match": "proportion", "poison_rate": "proportion",
                 "audit.precision*": "proportion", "audit.recall": "proportion"}  # fmt: skip
HEADLINE = Headline(
    rows=(("none (undefended)", "none"), ("RoCLIP-style", "roclip"), ("SafeCLIP-style", "safeclip"),
          ("CleanCLIP-style", "cleanclip"), ("OTCCLIP", "otcclip"), ("poison-free oracle", "oracle")),
    cols=(("zero-shot accuracy", "zeroshot_acc"), ("linear-probe accuracy", "linear_probe_acc"),
          ("targeted ASR", "asr_targeted"), ("backdoor ASR", "asr_backdoor")),
    pattern="{row}.{col}", corner="defense", caption="Clean accuracy (higher is better) and attack success (lower)")  # fmt: skip


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [null_as_nan(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and x == x


_TESTBED_TITLES = {
    "fashion_mnist": "the poisoned mosaic testbed",
    "fashion_web": "the poisoned web-like testbed",
    "shapes": "the poisoned shapes testbed",
}


def report_sections(run_dir: Path) -> list[Section]:
    """Table, plots and notes of the comparison, from the saved files of ``run_dir``."""
    from reprlab.report.figures import pyplot

    plt = pyplot()
    run_dir = Path(run_dir)
    results = null_as_nan(json.loads((run_dir / "analysis" / "results.json").read_text()))
    data = json.loads((run_dir / "analysis" / "data.json").read_text())
    defenses = list(results)
    metrics = (
        "zeroshot_acc",
        "linear_probe_acc",
        "asr_targeted",
        "asr_backdoor",
        "rematch_poison_moved",
        "rematch_clean_kept",
        "flag_poison_flagged",
        "flag_backdoor_flagged",
        "flag_share",
    )
    rows = [{"defense": d, **{m: results[d].get(m, float("nan")) for m in metrics}} for d in defenses]
    sections = []
    gate = results.get("none", {})
    notes = (
        []
        if "n_clean" not in data
        else [
            (
                f"Data [ours]: {data['n_clean']} web-like Fashion-MNIST pairs (one real item per image, paraphrased "
                f"captions with attributes; {data.get('n_caption_noise_generic', 0)} generic and "
                f"{data.get('n_caption_noise_wrong', 0)} wrong-class alt-text captions), "
                if data.get("testbed") == "fashion_web"
                else f"Data [ours]: {data['n_clean']} {data.get('testbed', 'fashion_mnist')} mosaic pairs with "
                "generated compositional captions, "
            )
            + f"{data['n_targeted']} targeted-poison pairs ({len(data['targets'])} targets) and {data['n_backdoor']} "
            f"{data['trigger']} backdoor pairs (target '{data['backdoor_target']}'). "
            + (
                "Real Fashion-MNIST item images; scenes (or canvases) and captions are composed by us, not a web "
                "corpus."
                if data.get("testbed", "fashion_mnist") in ("fashion_mnist", "fashion_web")
                else "GENERATED shapes data (not real images)."
            ),
            "Evaluation: single held-out test items (chance = 1 / #classes"
            + (": 0.10 on Fashion-MNIST's 10" if data.get("testbed", "fashion_mnist") != "shapes" else "")
            + f"). ASR per RoCLIP/CleanCLIP definitions; the targeted ASR is over {len(data['targets'])} target "
            f"images, so one run's moves in steps of {1 / max(len(data['targets']), 1):.2f}. Re-matching columns: share of poisoned pairs moved off poison captions / clean pairs "
            "kept on a same-content caption, in the last matching epoch [ours]. Flag columns (OTCCLIP's "
            "consensus flag [ours]): share of poisoned pairs / of all pairs flagged at the end of training.",
        ]
    )
    if data.get("streamed"):
        notes.insert(
            0,
            f"Streamed training data [ours]: {data['n_pairs']} pairs from {data['source']} ({data['slots']} slots, "
            f"{data['num_workers']} DataLoader workers per rank, windows of {data['window_batches']} global batches: "
            "shuffling and SafeCLIP-style splits work per window).",
        )
    # a user's data may hold one attack only (targeted poisons and no trigger, or the reverse): name what was measured
    asrs = {k: gate[k] for k in ("asr_targeted", "asr_backdoor") if _finite(gate.get(k))}
    if asrs:
        attacked = max(asrs.values())
        measured = ", ".join(f"{k.removeprefix('asr_')} {v:.2f}" for k, v in asrs.items())
        zs = f"; zero-shot {gate['zeroshot_acc']:.2f}" if _finite(gate.get("zeroshot_acc")) else ""
        notes.append(
            f"Gate: undefended CLIP ASR {measured} "
            f"({'attacked' if attacked >= 0.5 else 'NOT successfully attacked'}){zs}."
        )
    if "otcclip" in results:
        notes.append(_which_otcclip(run_dir))
    # run folders written before data.json named its testbed were all mosaics; user data (shards, files) is "yours"
    title = "OTCCLIP vs baselines on " + _TESTBED_TITLES.get(
        data.get("testbed", "fashion_mnist"), "your data"
    )
    if "eval_zeroshot_dir" in data:
        title = "OTCCLIP vs baselines on your data"
        notes += folder_notes(data)
    sections.append(Section(title, "\n".join(notes), table=rows))

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.4))
    x = np.arange(len(defenses))
    for ax, keys, title in (
        (axes[0], ("asr_targeted", "asr_backdoor"), "attack success rate"),
        (axes[1], ("zeroshot_acc", "linear_probe_acc"), "clean accuracy"),
    ):
        for j, k in enumerate(keys):
            ax.bar(x + (j - 0.5) * 0.38, [results[d].get(k, np.nan) for d in defenses], 0.38, label=k)
        ax.set_xticks(x, defenses)
        ax.set_ylim(0, 1)
        ax.set_title(title)
        ax.set_ylabel("share of test items")
        ax.legend()
    fig.tight_layout()
    sections.append(Section("ASR and accuracy per defense", figure=fig))

    log = _read_jsonl(run_dir / "metrics.jsonl")
    ot_rows = [
        {
            "defense": r["defense"],
            "epoch": r["epoch"],
            "max marginal error": r["ot_max_marginal_error"],
            "converged share": r["ot_converged_share"],
        }
        for r in log
        if "ot_max_marginal_error" in r
    ]
    if ot_rows:
        sections.append(
            Section(
                "Re-matching OT convergence",
                "Largest L1 marginal error of the re-matching OT solves per matching epoch, and the share of solves "
                "within defense.ot.match_tol (null tolerance: judged against 1e-4). Above tolerance the trainer "
                "warns; the ranking of candidates can then depend on solver error.",
                table=ot_rows,
                collapsed=True,
            )
        )
    if log:
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
        for d in defenses:
            pts = [r for r in log if r.get("defense") == d]
            for ax, k in zip(axes, ("zeroshot_acc", "asr_targeted", "asr_backdoor")):
                ax.plot([r["epoch"] for r in pts], [r.get(k, np.nan) for r in pts], marker="o", ms=3, label=d)
                ax.set_title(k)
                ax.set_xlabel("epoch")
        axes[0].legend()
        fig.tight_layout()
        sections.append(
            Section("Training curves", "Evaluated after every epoch (metrics.jsonl).", figure=fig)
        )

    audit_path = run_dir / "analysis" / "audit.json"
    if audit_path.exists():
        a = json.loads(audit_path.read_text())
        base = a["n_poison"] / a["n_pairs"] if a.get("n_pairs") else None
        chance = (f" A flag drawn at random has precision {fmt(base)} (the poisons' share of the pairs); a "
                  "precision at or below it finds nothing." if base is not None else "")  # fmt: skip
        row = {"pairs": a.get("n_pairs", "–"), "poisons": a.get("n_poison", "–"), "flagged": a["n_flagged"],
               "precision": a["precision"], "recall": a["recall"],
               "precision of the top #poisons": a["precision_at_n_poison"]}  # fmt: skip
        sections.append(
            Section(
                "Audit of the poisoned training set [ours, beyond the paper]",
                f"`reprlab otcclip audit` with the model trained under '{a['model']}': a pair is flagged when "
                "another caption beats its own under S = alpha cos - (1 - alpha) OT distance"
                + (f" (alpha = {a['alpha']})" if "alpha" in a else "")
                + f". Poisons = targeted + backdoor pairs.{chance} Full ranking: "
                "audit/flagged.csv, thumbnails: audit/audit.html.",
                table=[row],
            )
        )

    for d in ("otcclip", "roclip"):
        path = run_dir / "analysis" / f"examples_{d}.json"
        examples = json.loads(path.read_text()) if path.exists() else []
        if not examples:
            continue
        fig, axes = plt.subplots(1, len(examples), figsize=(2.8 * len(examples), 3.8), squeeze=False)
        for ax, e in zip(axes[0], examples):
            img = np.asarray(e["image"], dtype=np.uint8).transpose(1, 2, 0)
            ax.imshow(img.squeeze(-1) if img.shape[-1] == 1 else img, cmap="gray")
            ax.axis("off")
            tag = {0: "clean", TARGETED: "targeted", BACKDOOR: "backdoor"}[e["kind"]]
            ax.set_title(f"[{tag}]\norig: {_wrap(e['original'])}\nnew: {_wrap(e['reassigned'])}", fontsize=8)
        fig.tight_layout()
        sections.append(Section(f"Re-assigned captions ({d}, last matching epoch)", figure=fig))
    return sections


def _which_otcclip(run_dir: Path) -> str:
    """Whether the 'otcclip' row is our re-design or the reconstruction of the paper's swap (the claims quote the
    paper's abstract either way)."""
    from reprlab.recipes import saved_config

    d = saved_config(run_dir).get("defense") or {}
    if d.get("flag", "none") != "none" and d.get("rematch", True):
        return (
            "The 'otcclip' row is our re-design's flag [ours] with our reconstruction of the paper's "
            'nearest-caption swap on top (docs/otcclip_testbed.md, "A consensus flag").'
        )
    if d.get("flag", "none") != "none":
        return ("The 'otcclip' row is our re-design [ours]: a neighbour-consensus flag takes pairs out of the "
                "cross-modal loss in place of the paper's nearest-caption swap, with OT alignment losses at weight "
                f"{d.get('lambda_inter')}; the claims quoting the paper's abstract are judged on it "
                "(docs/otcclip_testbed.md, \"A consensus flag\", which also gives the overrides that run our "
                "reconstruction of the paper's swap).")  # fmt: skip
    return (
        "The 'otcclip' row is our reconstruction of the paper's method from its abstract [ours]: OT-distance "
        "caption re-matching and OT alignment losses (docs/otcclip.md)."
    )


def folder_notes(data: dict) -> list[str]:
    """What a folder evaluation ran on (``analysis/data.json``'s ``eval_*`` and poison keys)."""
    notes = []
    if data.get("testbed") == "files":
        notes.append(
            "Data [ours]: real Fashion-MNIST items written as a user's files (PNG files + captions.csv made from the "
            "labels with our caption templates; ImageFolders of held-out items), poisoned by `reprlab otcclip "
            "poison`."
        )
    notes.append(
        f"Evaluation on your images: zero-shot over {data['eval_n_zeroshot']} images of {data['eval_zeroshot_dir']} "
        f"({len(data['eval_classes'])} classes, {data['eval_n_templates']} prompt templates); linear probe fitted "
        f"on {data['eval_n_probe_train']} images (CLIP's logistic regression)."
    )
    if "poison_manifest" in data:
        bd = (f"a {data['trigger']} backdoor (target '{data['backdoor_target']}', ASR over triggered images of other "
              "classes)") if "trigger" in data else "no backdoor"  # fmt: skip
        notes.append(
            f"Poisons from {data['poison_manifest']}: {data['n_poisoned']} planted pairs "
            f"(rate {data.get('poison_rate', float('nan')):.4f}), {data['n_targets']} targeted images, {bd}."
        )
    return notes


def _wrap(text: str, width: int = 34) -> str:
    out, line = [], ""
    for w in text.split():
        if len(line) + len(w) + 1 > width:
            out.append(line)
            line = w
        else:
            line = f"{line} {w}".strip()
    return "\n".join([*out, line])
