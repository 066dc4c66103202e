"""rote-thr-*: Reason to Rote on two-hop relational reasoning (THR) with noisy answers.

Objective: train a small GPT from scratch on atomic facts + two-hop questions (5% of training questions
with a fixed wrong answer) and measure, as in Du et al., *Reason to Rote* (EMNLP 2025, arXiv 2507.04782):
training dynamics, how far two-hop reasoning generalises to held-out questions, the logit lens on noisy
questions (true vs noisy answer), a linear probe for the bridge entity (trained on clean questions,
evaluated on noisy ones), and INLP removal of the bridge subspace with a random control.

Paper vs ours: the task and analyses are the paper's; entity counts, templates, splits, model and all
analysis choices are **[ours]**. Small models generalise two-hop composition poorly without grokking-length
training (Wang et al. 2024, arXiv 2405.15071), so held-out accuracy is reported as measured, not tuned for.
Circuits and neurons are FDA-only in this recipe.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from reprlab.errors import DataError
from reprlab.hooks import hooks
from reprlab.interp.inlp import inlp, project_out_hook, random_projection
from reprlab.interp.logit_lens import logit_lens, residual_names
from reprlab.interp.probing import collect, probe_grid
from reprlab.methods.reason_to_rote.dataset import Vocab, load_dataset, tensorize
from reprlab.methods.reason_to_rote.evaluate import answer_matches, evaluate
from reprlab.methods.reason_to_rote.lm import HFOptions, build_lm, save_lm
from reprlab.methods.reason_to_rote.thr import THRConfig, generate_thr, validate_thr_item
from reprlab.methods.reason_to_rote.train import TrainConfig, run_dist, train
from reprlab.models.gpt import GPT, GPTConfig
from reprlab.report.headline import Headline
from reprlab.train.dist import main_first
from reprlab.train.seed import seed_everything


@dataclass(frozen=True)
class ModelConfig(HFOptions):
    """Our GPT's size [ours] (d_vocab and n_ctx are set from the task), or a HF causal LM (``hf_id``)."""

    n_layers: int = field(default=4, metadata={"help": "transformer blocks", "ge": 1})
    d_model: int = field(default=128, metadata={"help": "residual stream width", "ge": 1})
    n_heads: int = field(default=4, metadata={"help": "attention heads (must divide d_model)", "ge": 1})
    d_mlp: int = field(default=512, metadata={"help": "MLP hidden width", "ge": 1})


@dataclass(frozen=True)
class Config:
    seed: int = field(default=0, metadata={"help": "seed for data, init and batch order"})
    device: str = field(default="auto", metadata={"help": "auto | cpu | cuda"})
    threads: int = field(default=0, metadata={"help": "torch CPU threads (0 = torch's default)"})
    task: THRConfig = field(default_factory=THRConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    inlp_iters: int = field(default=8, metadata={"help": "max INLP classifiers for the bridge entity"})
    inlp_max_rank: int = field(default=16, metadata={"help": "cap on removed INLP directions (multi-class)"})


def thr_selection_split(n: int, seed: int, frac: float = 0.2) -> tuple[np.ndarray, np.ndarray]:
    """(select, fit) indices of the clean training questions: ``frac`` of them choose the probe cell only."""
    perm = np.random.default_rng(seed + 11).permutation(n)
    k = max(1, int(round(frac * n)))
    return np.sort(perm[:k]), np.sort(perm[k:])


def _em(model, batch, ids, fwd=()) -> float:
    with hooks(model, list(fwd)):
        return (
            answer_matches(model, ids.to(next(model.parameters()).device), batch).all(1).float().mean().item()
        )


def preflight(cfg: Config) -> None:
    """Fail before the run folder exists when ``model.hf_id`` is not available offline, or its folder has a
    config transformers cannot read, no weights, or no tokenizer where the task tokens need one."""
    if cfg.model.hf_id:
        from reprlab.methods.reason_to_rote.lm import preflight_lm

        preflight_lm(cfg.model, generate_thr(cfg.task, cfg.seed))  # on the run's own (deterministic) data


def run(cfg: Config, run) -> dict:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    seed_everything(cfg.seed)
    folder = run.dir / "data"
    run_dist(run)  # under torchrun: join the ranks; rank 0 writes the data, the others read the stage back
    save = lambda: (generate_thr(cfg.task, cfg.seed).save(folder), {"folder": "data"})[1]  # noqa: E731
    main_first(lambda: run.stage("data", save), run.is_main)
    ds = load_dataset(folder, validate_thr_item)
    vocab = Vocab(ds.manifest["vocab"], ds.manifest["tokenizer"])
    train_items, test_items = ds.splits["train"], ds.splits["test"]
    facts = [it for it in train_items if it.kind == "fact"]
    clean_q = [it for it in train_items if it.kind == "two_hop" and not it.noisy]
    noisy_items = [it for it in train_items if it.noisy]
    if not noisy_items:
        raise DataError(
            "the THR training split has no noisy questions; the analyses need task.noise_rate > 0"
        )
    train_set, test = tensorize(train_items, vocab), tensorize(test_items, vocab)
    facts_b, clean_b, noisy = (
        tensorize(facts, vocab),
        tensorize(clean_q, vocab),
        tensorize(noisy_items, vocab),
    )

    mc = cfg.model
    lm = None
    if mc.hf_id:  # a HF causal LM behind our GPT's call; every batch in its token ids (lm.py)
        lm = build_lm(
            mc.hf_id, mc.from_config, mc.tokens, vocab, train_set.ids.shape[1], cfg.seed, run.device
        )
        train_set, test, facts_b, clean_b, noisy = (
            lm.remap(b) for b in (train_set, test, facts_b, clean_b, noisy)
        )
        model = lm.model
        run.save_json("analysis/model.json", lm.info)
    else:
        torch.manual_seed(cfg.seed)
        model = GPT(GPTConfig(d_vocab=len(vocab), n_ctx=train_set.ids.shape[1], n_layers=mc.n_layers,
                              d_model=mc.d_model, n_heads=mc.n_heads, d_mlp=mc.d_mlp))  # fmt: skip
    tr = train(model, train_set, test, cfg.train, run, cfg.seed, dist=run_dist(run))
    model.to(run.device).eval()
    if lm is not None:
        run.stage("export", lambda: save_lm(lm, run.dir / "model"))

    def final_eval() -> dict:
        m = evaluate(model, test, clean_b, noisy, run.device)
        return {**asdict(m), "facts_em": _em(model, facts_b, facts_b.ids), "steps": tr.step,
                "train_seconds": round(tr.seconds, 1), "n_test": len(test_items), "n_noisy": len(noisy_items),
                "n_facts": len(facts), "n_clean_questions": len(clean_q)}  # fmt: skip

    final = run.stage("final_eval", final_eval)
    run.save_json("analysis/final_eval.json", final)

    def lens() -> dict:
        at = noisy.answer_start
        rows = torch.arange(len(noisy))
        res = logit_lens(model, noisy.ids, at - 1, noisy.ids_true[rows, at], noisy.ids[rows, at])
        return {**res.to_json(), "labels": {"a": "true answer", "b": "noisy label"}}

    run.save_json("analysis/logit_lens.json", run.stage("logit_lens", lens))
    names = residual_names(model)
    layers = ["embed"] + [f"block{i}" for i in range(len(names) - 1)]
    # positions in 'who is the <r2> of the <r1> of <e> ?': r1 (6), entity (8), '?' (9, predicts the answer)
    positions = [6, 8, 9]
    person = {p: i for i, p in enumerate(ds.manifest["people"])}

    def probes() -> dict:
        # [ours] the cell is chosen on clean training questions held out from the probe's fit
        # (``select``), disjoint from the noisy questions and held-out test questions it is reported on
        sel_idx, fit_idx = thr_selection_split(len(clean_q), cfg.seed)
        fit_b, sel_b = clean_b.select(torch.as_tensor(fit_idx)), clean_b.select(torch.as_tensor(sel_idx))
        acts = {n: collect(model, b.ids, names, positions) for n, b in
                (("train", fit_b), ("select", sel_b), ("test", test), ("noisy", noisy))}  # fmt: skip
        bridge = np.array([person[it.meta["bridge"]] for it in clean_q])
        ys = {"train": bridge[fit_idx], "select": bridge[sel_idx]}
        ys |= {n: np.array([person[it.meta["bridge"]] for it in items]) for n, items in
               (("test", test_items), ("noisy", noisy_items))}  # fmt: skip
        grid = probe_grid("bridge", acts["train"], ys["train"], {"select": (acts["select"], ys["select"]),
                          "noisy": (acts["noisy"], ys["noisy"]), "heldout_test": (acts["test"], ys["test"])},
                          layers, positions, seed=cfg.seed)  # fmt: skip
        li, pi = grid.best  # argmax over the first evaluation set: ``select``
        # control: the same probe on an untrained model of the same shape (entity identity alone)
        if lm is not None:
            rand = lm.untrained()  # random init from the same config, seeded with seed + 1
        else:
            torch.manual_seed(cfg.seed + 1)
            rand = GPT(model.cfg).to(run.device).eval()
        ra = {
            n: collect(rand, b.ids, [names[li]], [positions[pi]])
            for n, b in (("train", fit_b), ("noisy", noisy))
        }
        rgrid = probe_grid("bridge", ra["train"], ys["train"], {"noisy": (ra["noisy"], ys["noisy"])},
                           layers[li:li + 1], positions[pi:pi + 1], seed=cfg.seed, shuffle_control=False)  # fmt: skip
        return {**grid.to_json(), "best_layer": layers[li], "best_position": positions[pi],
                "acc_noisy_random_model": float(rgrid.acc["noisy"][0, 0]),
                "acc_select": float(grid.acc["select"][li, pi]), "n_select": len(sel_idx),
                "acc_noisy": float(grid.acc["noisy"][li, pi]), "acc_heldout": float(grid.acc["heldout_test"][li, pi]),
                "acc_shuffled": float(grid.acc_shuffled[li, pi]),
                "n_classes_train": int(len(np.unique(ys["train"])))}  # fmt: skip

    pr = run.stage("probes", probes)
    run.save_json("analysis/probes.json", pr)

    def inlp_stage() -> dict:
        # INLP targets the probe's cell, chosen on held-out clean questions (not on the noisy ones it is scored on)
        li, pi = layers.index(pr["best_layer"]), positions.index(pr["best_position"])
        li = max(li, 1)  # the embedding layer holds no computed bridge
        x = collect(model, clean_b.ids, [names[li]], [positions[pi]])[0, :, 0].numpy()
        y = np.array([person[it.meta["bridge"]] for it in clean_q])
        res = inlp(x, y, n_iters=cfg.inlp_iters, seed=cfg.seed, max_rank=cfg.inlp_max_rank)
        h = [(names[li], project_out_hook(res.projection, [positions[pi]]))]
        hr = [
            (names[li], project_out_hook(random_projection(x.shape[1], res.rank, cfg.seed), [positions[pi]]))
        ]
        out = {"layer": layers[li], "position": positions[pi], "rank": res.rank, "accuracies": res.accuracies}
        for tag, fwd in (("before", []), ("inlp", h), ("random", hr)):
            out[tag] = {"noisy_memorized": _em(model, noisy, noisy.ids, fwd),
                        "noisy_true_answer": _em(model, noisy, noisy.ids_true, fwd),
                        "clean_train_em": _em(model, clean_b, clean_b.ids, fwd)}  # fmt: skip
        out["memorization_drop"] = out["before"]["noisy_memorized"] - out["inlp"]["noisy_memorized"]
        out["random_memorization_drop"] = out["before"]["noisy_memorized"] - out["random"]["noisy_memorized"]
        return out

    il = run.stage("inlp", inlp_stage)
    run.save_json("analysis/inlp.json", il)
    return {
        "heldout_two_hop_em": final["clean_test_em"], "train_two_hop_em": final["clean_train_em"],
        "facts_em": final["facts_em"], "noisy_memorized": final["noisy_memorized"],
        "noisy_true_answer": final["noisy_true_answer"], "probe_bridge_acc_noisy": pr["acc_noisy"],
        "probe_bridge_acc_heldout": pr["acc_heldout"], "probe_bridge_acc_shuffled": pr["acc_shuffled"],
        "probe_bridge_acc_noisy_random_model": pr["acc_noisy_random_model"],
        "inlp_memorization_drop": il["memorization_drop"], "inlp_random_drop": il["random_memorization_drop"],
        "inlp_rank": il["rank"], "inlp_clean_train_drop": il["before"]["clean_train_em"] - il["inlp"]["clean_train_em"],
        "steps": final["steps"], "train_seconds": final["train_seconds"], "n_noisy": final["n_noisy"],
    }  # fmt: skip


SUMMARY_KINDS = {"*_em": "proportion", "noisy_*": "proportion", "probe_bridge_acc_*": "proportion"}
HEADLINE = Headline(
    rows=(("noisy two-hop answers memorised", "noisy_memorized"), ("atomic facts learned", "facts_em"),
          ("held-out two-hop exact match", "heldout_two_hop_em"),
          ("bridge entity decoded on noisy questions", "probe_bridge_acc_noisy"),
          ("  … by the same probe on an untrained model", "probe_bridge_acc_noisy_random_model"),
          ("memorisation drop, bridge subspace removed (INLP)", "inlp_memorization_drop"),
          ("  … random subspace of the same rank", "inlp_random_drop")),
    caption="Two-hop reasoning with noisy answers")  # fmt: skip


def report_sections(run_dir: Path):
    from reprlab.methods.reason_to_rote.report import thr_sections

    return thr_sections(Path(run_dir))
