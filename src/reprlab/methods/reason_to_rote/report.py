"""Report sections for the Reason-to-Rote recipes, built only from files in the run folder."""

from __future__ import annotations

import json
from pathlib import Path

from reprlab.jsonfile import null_as_nan
from reprlab.report import Section
from reprlab.report.figures import pyplot

PAPER_NOTE = (
    "Paper: Du et al., Reason to Rote (EMNLP 2025, arXiv 2507.04782). Task formats, model, training and "
    "every analysis choice below are [ours]; compare with the paper qualitatively only."
)


def _read(path: Path):
    return null_as_nan(json.loads(path.read_text())) if path.exists() else None  # NaN is written as null


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [null_as_nan(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def _plt():
    return pyplot()


def dynamics_section(
    run_dir: Path, keys: list[tuple[str, str]], title: str = "Training dynamics"
) -> Section | None:
    rows = [r for r in _metrics(run_dir) if keys[0][0] in r]
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8.5, 4.4))
    steps = [r["step"] for r in rows]
    for key, label in keys:
        ax.plot(steps, [r.get(key, float("nan")) for r in rows], label=label, marker=".", lw=1.6)
    ax.set_xlabel("training step")
    ax.set_ylabel("exact-match share")
    ax.set_title("Exact match along training")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(loc="center right")
    fig.tight_layout()
    text = f"Exact match along training (greedy answers, {len(rows)} evaluations). " + _dynamics_words(rows)
    return Section(title, text, figure=fig)


def _dynamics_words(rows: list[dict]) -> str:
    """What the curves show, said only as far as the metrics show it: a true-answer peak followed by a
    memorised share that overtakes it, or whichever part of that is missing."""
    true = [(r["step"], r["noisy_true_answer"]) for r in rows if _finite(r.get("noisy_true_answer"))]
    mem = [(r["step"], r["noisy_memorized"]) for r in rows if _finite(r.get("noisy_memorized"))]
    if not true or not mem:
        return "The noisy items' curves were not logged."
    step, peak = max(true, key=lambda x: x[1])
    last_step, last_mem = mem[-1]
    said = f"On noisy training items the true-answer rate peaks at {peak:.3f} (step {step})"
    if step == true[-1][0]:
        said += ", at the last evaluation: it has not fallen back"
    if last_mem <= 0:
        return said + "; no noisy label is memorised by the end (memorised share 0)."
    later = [v for s, v in true if s > step]
    if later and last_mem > later[-1]:
        return (said + f", then the memorised share overtakes it, ending at {last_mem:.3f} against a true-answer "
                f"rate of {later[-1]:.3f}: the generalise-then-memorise pattern.")  # fmt: skip
    return (
        said + f"; the memorised share ends at {last_mem:.3f} (step {last_step}), below the true-answer rate."
    )


def _finite(v) -> bool:
    return isinstance(v, int | float) and v == v and abs(v) != float("inf")


def sweep_curves_section(seed_dirs: list[Path]) -> Section | None:
    """Per-seed curves of clean test EM, noisy memorisation and the true-answer rate on noisy items.

    For a sweep laid out as ``DIR/seed-<s>/`` (what ``reprlab run ... --seeds`` writes): one panel per
    seed, each from that run's ``metrics.jsonl``, with the stopping step marked.
    """
    runs = [(Path(d), _metrics(Path(d))) for d in seed_dirs]
    runs = [(d, [r for r in rows if "noisy_memorized" in r]) for d, rows in runs]
    runs = [(d, rows) for d, rows in runs if rows]
    if not runs:
        return None
    plt = _plt()
    fig, axes = plt.subplots(
        1, len(runs), figsize=(max(6.0, 4.2 * len(runs)), 4.0), sharey=True, squeeze=False
    )
    for ax, (d, rows) in zip(axes[0], runs):
        steps = [r["step"] for r in rows]
        for key, label in (("clean_test_em", "clean test EM"), ("noisy_memorized", "noisy: memorised"),
                           ("noisy_true_answer", "noisy: true answer")):  # fmt: skip
            ax.plot(steps, [r[key] for r in rows], label=label)
        ax.axvline(steps[-1], color="grey", lw=0.8, ls="--")
        ax.set_title(d.name)
        ax.set_xlabel("training step")
    axes[0][0].set_ylabel("exact-match share")
    axes[0][0].legend(loc="center right")
    fig.tight_layout()
    return Section("Dynamics per seed", "Greedy exact match along training, one panel per seed; the dashed line "
                   "is where the stopping rule ended the run.", figure=fig)  # fmt: skip


def model_section(an: Path) -> Section | None:
    """What a run trained when it trained a Hugging Face model (``analysis/model.json``); None for our GPT."""
    info = _read(an / "model.json")
    if not info:
        return None
    how = (
        "trained from scratch from its config"
        if info["from_config"]
        else "fine-tuned from its pretrained weights"
    )
    ids = ", ".join(f"{k} -> {v}" for k, v in info["token_ids"].items())
    text = (f"{info['architecture']} `{info['hf_id']}` ({info['n_params'] / 1e6:.2f}M parameters, "
            f"{info['n_layers']} layers, d_model {info['d_model']}, {info['n_heads']} heads), {how}, every "
            f"analysis through the hook sites of reprlab.hooks.sites. Task tokens -> model ids [ours, "
            f"model.tokens={info['tokens']}]: {ids}" + (f"; new tokens: {info['new_tokens']}" if info["new_tokens"] else "")
            + ". The trained model is in model/ (transformers' from_pretrained loads it).")  # fmt: skip
    return Section("Model", text)


def setup_text(run_dir: Path, task: str) -> str:
    """What was trained on what, from the run's config, and what the run's memorisation lets it say: a run that
    memorised fewer than half of its noisy labels (a demo stops at the generalisation phase) measures every
    mechanism on a model that has not memorised."""
    from reprlab.recipes import saved_config

    cfg = saved_config(run_dir)
    t, m, tr = cfg.get("task") or {}, cfg.get("model") or {}, cfg.get("train") or {}
    parts = [f"Task: {task}"]
    if t.get("n_train") is not None:
        parts[0] += f", {t['n_train']:,} training items, {t.get('n_test', 0):,} clean test items"
    elif t.get("n_people") is not None:
        parts[0] += (
            f", {t['n_people']} people, {t.get('n_orgs')} organisations, {t.get('n_relations')} relations"
        )
    if t.get("noise_rate") is not None:
        parts[0] += f", {t['noise_rate'] * 100:g} % of training labels noisy"
    if m.get("hf_id"):
        parts.append(f"model: `{m['hf_id']}` (below)")
    elif m.get("n_layers"):
        parts.append(f"model: our GPT ({m['n_layers']} layers, d_model {m.get('d_model')}, {m.get('n_heads')} "
                     "heads), trained from scratch")  # fmt: skip
    limit = tr.get("max_steps") or tr.get("steps")
    if limit:
        parts.append(f"at most {limit:,} training steps")
    text = "; ".join(parts) + ". "
    summary = _read(run_dir / "summary.json") or {}
    memo = summary.get("noisy_memorized")
    if isinstance(memo, float | int) and memo == memo and memo < 0.5:
        text += (f"**This run memorised {memo * 100:.0f} % of the noisy labels**, under the 50 % the mechanism claims "
                 "need: they are n/a, and the mechanism numbers below (probes, INLP, circuits, neurons) are "
                 "measured on a model that has not memorised, so they say nothing about memorisation. ")  # fmt: skip
    return text + PAPER_NOTE


def fda_sections(run_dir: Path) -> list[Section]:
    an = run_dir / "analysis"
    out: list[Section] = [Section("Reason to Rote: FDA", setup_text(run_dir, "four-digit addition (FDA)"))]
    if (model := model_section(an)) is not None:
        out.append(model)
    final = _read(an / "final_eval.json")
    if final:
        out.append(
            Section(
                "Final evaluation",
                table=[{k: v for k, v in final.items() if k != "test_digit_acc"}],
                text=f"Per-answer-token test accuracy (teacher-forced, last = EOS): {final['test_digit_acc']}",
            )
        )
    dyn = dynamics_section(
        run_dir,
        [
            ("clean_test_em", "clean test EM"),
            ("noisy_memorized", "noisy: memorised label"),
            ("noisy_true_answer", "noisy: true answer"),
            ("clean_train_em", "clean train EM"),
        ],
    )
    if dyn:
        out.append(dyn)
    plt = _plt()
    lens = _read(an / "logit_lens.json")
    if lens:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        x = range(len(lens["layers"]))
        axes[0].plot(x, lens["mean_prob_a"], marker="o", label="true y*")
        axes[0].plot(x, lens["mean_prob_b"], marker="o", label="noisy ỹ")
        axes[0].set_ylabel("mean probability")
        axes[1].plot(x, lens["median_rank_a"], marker="o", label="true y*")
        axes[1].plot(x, lens["median_rank_b"], marker="o", label="noisy ỹ")
        axes[1].set_ylabel("median rank (0 = top)")
        for ax in axes:
            ax.set_xticks(list(x), lens["layers"], rotation=20)
            ax.set_xlabel("layer (residual stream read through the unembedding)")
            ax.legend()
        axes[0].set_title("Probability of each answer")
        axes[1].set_title("Rank of each answer")
        fig.tight_layout()
        out.append(Section(
            "Logit lens on noisy items",
            f"{lens['n_items']} noisy training items, read at the first answer position where ỹ and y* differ. "
            "Share with y* ranked above ỹ per layer: "
            + ", ".join(f"{la} {v:.2f}" for la, v in zip(lens["layers"], lens["share_a_above_b"])) + ".",
            table=[{"layer": layer, "p(y*)": a, "p(ỹ)": b, "top1 y*": ta, "top1 ỹ": tb}
                   for layer, a, b, ta, tb in zip(lens["layers"], lens["mean_prob_a"], lens["mean_prob_b"],
                                                  lens["top1_a"], lens["top1_b"])], figure=fig))  # fmt: skip
    lot = _read(an / "lens_over_training.json")
    if lot and lot["snapshots"]:
        snaps = lot["snapshots"]
        fig, ax = plt.subplots(figsize=(8.5, 4.2))
        for li, layer in enumerate(snaps[0]["layers"]):
            ax.plot(
                [s["step"] for s in snaps],
                [s["share_true_above_noisy"][li] for s in snaps],
                marker="o",
                label=layer,
            )
        ax.set_xlabel("training step (snapshot)")
        ax.set_ylabel("share: y* ranked above ỹ")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title("True answer above the memorised one, per layer")
        # a 30-block HF model has 31 layers: the legend goes beside the axes, in columns
        n_layers = len(snaps[0]["layers"])
        ax.legend(title="layer", fontsize=7 if n_layers > 8 else None, ncol=1 + (n_layers - 1) // 16,
                  loc="center left", bbox_to_anchor=(1.0, 0.5))  # fmt: skip
        fig.tight_layout()
        out.append(
            Section(
                "Logit lens over training",
                "Per snapshot and layer, the share of noisy items whose true "
                "answer token outranks the memorised one at the first differing position.",
                figure=fig,
            )
        )
    probes = _read(an / "probes.json")
    if probes:
        names = [f"carry{k}" for k in range(4)]
        fig, axes = plt.subplots(2, 4, figsize=(14, 6.4), squeeze=False, constrained_layout=True)
        for j, name in enumerate(names):
            g = probes["grids"][name]
            for i, split in enumerate(("clean_test", "noisy")):
                ax = axes[i][j]
                im = ax.imshow(g["acc"][split], vmin=0.5, vmax=1.0, cmap="viridis", aspect="auto")
                ax.set_title(f"{name}, {split.replace('_', ' ')}")
                ax.set_yticks(range(len(g["layers"])), g["layers"] if j == 0 else [])
                ax.set_xticks(range(len(g["positions"])), g["positions"])
                ax.grid(False)
                if i == 1:
                    ax.set_xlabel("sequence position")
        fig.colorbar(im, ax=axes, shrink=0.6, label="probe accuracy")
        out.append(Section(
            "Linear probes for intermediate results",
            "Logistic-regression probes on the residual stream (rows: layers; columns: sequence positions), "
            "best cells chosen only at positions whose prefix holds no answer token that reveals the target (either "
            "digit order), on one half of the test items, and scored on the other half; "
            "trained on clean training items, evaluated on held-out clean items and on noisy items against the "
            f"true values. Mean carry accuracy at each carry's best cell: clean {probes['carry_acc_clean']:.3f}, "
            f"noisy {probes['carry_acc_noisy']:.3f} (only items whose probed position precedes the first wrong "
            f"label digit: {probes.get('carry_acc_noisy_shared_prefix', float('nan')):.3f}), shuffled-label control {probes['carry_acc_shuffled']:.3f}, "
            f"random-init model {probes['carry_acc_random_model']:.3f} (selectivity over it: "
            f"{probes.get('carry_selectivity', float('nan')):.3f}).",
            table=[{"target": k, **v} for k, v in probes["best"].items()], figure=fig))  # fmt: skip
    inlp = _read(an / "inlp.json")
    if inlp:
        rows = [{"condition": c, **inlp[c]} for c in ("before", "inlp", "random")]
        out.append(Section(
            "INLP: removing the carry subspaces",
            f"Memorisation drop {inlp['memorization_drop']:.3f} (random subspace of equal rank: "
            f"{inlp['random_memorization_drop']:.3f}); clean test EM drop {inlp['clean_drop']:.3f} (random: "
            f"{inlp['random_clean_drop']:.3f}). Cells: "
            + "; ".join(f"c{c['carry']}@{c['layer']}/pos{c['position']} rank {c['rank']}" for c in inlp["cells"]),
            table=rows))  # fmt: skip
    circ = _read(an / "circuits.json")
    if circ:
        keys = [
            "n_nodes",
            "top_k",
            "iou",
            "iou_null_unrelated",
            "iou_null_unrelated_pair",
            "iou_excess",
            "iou_random_baseline",
            "faithfulness_memorization",
            "faithfulness_generalization",
            "faithfulness_memorization_with_generalization_circuit",
        ]
        fig, ax = plt.subplots(figsize=(9, 4.2))
        hooks = sorted(set(circ["score_share_by_hook_memorization"]))
        w = 0.4
        ax.bar(
            [i - w / 2 for i in range(len(hooks))],
            [circ["score_share_by_hook_memorization"][h] for h in hooks],
            w,
            label="memorisation",
        )
        ax.bar(
            [i + w / 2 for i in range(len(hooks))],
            [circ["score_share_by_hook_generalization"][h] for h in hooks],
            w,
            label="generalisation",
        )
        ax.set_xticks(
            range(len(hooks)),
            [h.replace("blocks.", "b").replace(".hook_", ".") for h in hooks],
            rotation=30,
            ha="right",
        )
        ax.set_ylabel("share of |attribution|")
        ax.set_xlabel("hook point (block.site)")
        ax.set_title("Where each circuit's attribution sits")
        ax.legend()
        fig.tight_layout()
        out.append(Section(
            "Circuit overlap (node attribution patching)",
            "Top-k nodes (head × position, neuron × position) by |mean attribution| for the memorisation "
            "metric on noisy items and the generalisation metric on clean items; faithfulness with non-circuit "
            "nodes mean-ablated. Null: circuits of unrelated metrics (logit difference of a random digit pair) "
            "on the same items and positions; iou_excess = iou minus the larger mean IoU of either circuit with "
            "them (the uniform-random baseline is shown but is no evidence: it ignores positions).",
            table=[{k: circ.get(k) for k in keys}], figure=fig))  # fmt: skip
    neu = _read(an / "neurons.json")
    if neu:
        fig, ax = plt.subplots(figsize=(9, 4.0))
        ax.bar(range(len(neu["neurons"])), neu["z_noisy_by_neuron"])
        ax.set_xticks(range(len(neu["neurons"])), neu["neurons"], rotation=90)
        ax.set_xlabel("neuron (by memorisation attribution)")
        ax.set_ylabel("mean z on noisy items")
        ax.set_title("Shift of the top neurons on noisy items")
        fig.tight_layout()
        keys = [
            "hook",
            "z_noisy_abs",
            "z_clean_abs",
            "restore_rate",
            "true_before",
            "restore_rate_random",
            "restore_rate_random_matched",
            "restore_gain",
            "restore_gain_net",
            "memorized_before",
            "memorized_after",
            "clean_em_before",
            "clean_em_after",
        ]
        out.append(Section(
            "Outlier-heuristic neurons",
            "Top neurons of the MLP layer by memorisation attribution; z-scores against clean-item means "
            "conditional on the column sum; patching them to the clean-conditional mean at every answer position. "
            "restore_gain = restore_rate − true_before (items already answering y* are not restored); "
            "restore_gain_net subtracts the larger gain of random neurons (uniform, or attribution ranks K..4K).",
            table=[{k: neu.get(k) for k in keys}], figure=fig))  # fmt: skip
    return out


def thr_sections(run_dir: Path) -> list[Section]:
    an = run_dir / "analysis"
    out: list[Section] = [Section("Reason to Rote: THR", setup_text(run_dir, "two-hop relations (THR)") + " THR is data- and depth-hungry; "
                                  "held-out two-hop accuracy is reported as measured.")]  # fmt: skip
    if (model := model_section(an)) is not None:
        out.append(model)
    final = _read(an / "final_eval.json")
    if final:
        out.append(
            Section(
                "Final evaluation",
                "clean_test_em = held-out two-hop questions; clean_train_em = clean training questions.",
                table=[{k: v for k, v in final.items() if k != "test_digit_acc"}],
            )
        )
    dyn = dynamics_section(
        run_dir,
        [
            ("clean_test_em", "held-out two-hop EM"),
            ("noisy_memorized", "noisy: memorised"),
            ("noisy_true_answer", "noisy: true answer"),
            ("clean_train_em", "clean train EM"),
        ],
    )
    if dyn:
        out.append(dyn)
    lens = _read(an / "logit_lens.json")
    if lens:
        out.append(
            Section(
                "Logit lens on noisy questions",
                table=[
                    {"layer": la, "p(true)": a, "p(noisy)": b, "true above noisy": s}
                    for la, a, b, s in zip(
                        lens["layers"], lens["mean_prob_a"], lens["mean_prob_b"], lens["share_a_above_b"]
                    )
                ],
            )
        )
    pr = _read(an / "probes.json")
    if pr:
        out.append(
            Section(
                "Bridge-entity probe",
                f"Best cell {pr['best_layer']} / position {pr['best_position']}; "
                f"{pr['n_classes_train']} classes; majority rate {pr['majority']:.3f}.",
                table=[
                    {
                        k: pr.get(k)
                        for k in (
                            "acc_select",
                            "acc_noisy",
                            "acc_heldout",
                            "acc_shuffled",
                            "acc_noisy_random_model",
                        )
                    }
                ],
            )
        )
    il = _read(an / "inlp.json")
    if il:
        out.append(
            Section(
                "INLP: removing the bridge subspace",
                f"rank {il['rank']} at {il['layer']} / position {il['position']}",
                table=[{"condition": c, **il[c]} for c in ("before", "inlp", "random")],
            )
        )
    return out
