"""rote-fda-*: Reason to Rote on four-digit addition with noisy labels, trained from scratch, then analysed.

Objective: reproduce, qualitatively, the analyses of Du et al., *Reason to Rote: Rethinking Memorization in
Reasoning* (EMNLP 2025, arXiv 2507.04782) on a small GPT: generalise-then-memorise dynamics, the true
answer decodable under a memorised noisy label (logit lens), intermediate results (carries) still computed
on noisy items (probes), memorisation depending on them (INLP with a random control), overlap of the
memorisation and generalisation circuits (node attribution patching), and outlier-heuristic neurons
(z-scores and patch-back).

Paper vs ours: the tasks, the analyses and their names are the paper's; every format, size, architecture,
hyper-parameter, layer/position choice and summary statistic here is **[ours]** (the paper's are unknown
to us, see ``shared/papers/reason-to-rote.md``). Circuits are node-level (the paper uses edges).

Pipeline (each step a resumable stage): data -> train (checkpoints, dynamics) -> final eval -> logit lens
-> probes -> INLP -> circuits -> neurons -> summary. ``report_sections`` plots from the saved artefacts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from reprlab.methods.reason_to_rote import analyses as A
from reprlab.methods.reason_to_rote.dataset import Vocab, load_dataset, tensorize
from reprlab.methods.reason_to_rote.evaluate import answer_matches, evaluate
from reprlab.methods.reason_to_rote.fda import FDAConfig, cascading_carry, generate_fda, validate_fda_item
from reprlab.methods.reason_to_rote.train import TrainConfig, train
from reprlab.models.gpt import GPT, GPTConfig
from reprlab.train.seed import seed_everything


@dataclass(frozen=True)
class ModelConfig:
    """GPT size [ours]; d_vocab and n_ctx are set from the task."""

    n_layers: int = 2
    d_model: int = 64
    n_heads: int = 4
    d_mlp: int = 256


@dataclass(frozen=True)
class AnalysisConfig:
    """Analysis settings [ours]."""

    probe_items: int = field(default=1500, metadata={"help": "clean training items used to fit probes"})
    inlp_iters: int = field(default=8, metadata={"help": "max INLP classifiers removed per carry"})
    circuit_items: int = field(default=200, metadata={"help": "items per circuit"})
    circuit_top_frac: float = field(default=0.02, metadata={"help": "share of nodes kept in a circuit"})
    neuron_k: int = field(default=16, metadata={"help": "top neurons patched back"})
    neuron_layer: int = field(default=-1, metadata={"help": "MLP layer for the neuron analysis (-1 = last)"})


@dataclass(frozen=True)
class Config:
    seed: int = field(default=0, metadata={"help": "seed for data, init and batch order"})
    device: str = field(default="auto", metadata={"help": "auto | cpu | cuda"})
    threads: int = field(default=0, metadata={"help": "torch CPU threads (0 = torch's default)"})
    task: FDAConfig = field(default_factory=FDAConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    analysis: AnalysisConfig = field(default_factory=AnalysisConfig)


def _load_data(cfg: Config, run):
    folder = run.dir / "data"
    run.stage("data", lambda: (generate_fda(cfg.task, cfg.seed).save(folder), {"folder": "data"})[1])
    ds = load_dataset(folder, lambda it: validate_fda_item(it, cfg.task.digit_order))
    return ds, Vocab(ds.manifest["vocab"], ds.manifest["tokenizer"])


def run(cfg: Config, run) -> dict:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    seed_everything(cfg.seed)
    ds, vocab = _load_data(cfg, run)
    train_items, test_items = ds.splits["train"], ds.splits["test"]
    train_set, test = tensorize(train_items, vocab), tensorize(test_items, vocab)
    clean_items = [it for it in train_items if not it.noisy]
    noisy_items = [it for it in train_items if it.noisy]
    if not noisy_items:
        raise ValueError("the FDA training split has no noisy items; the analyses need noise_rate > 0")
    clean_all, noisy = tensorize(clean_items, vocab), tensorize(noisy_items, vocab)

    torch.manual_seed(cfg.seed)
    mc = cfg.model
    gcfg = GPTConfig(d_vocab=len(vocab), n_ctx=train_set.ids.shape[1], n_layers=mc.n_layers, d_model=mc.d_model,
                     n_heads=mc.n_heads, d_mlp=mc.d_mlp)  # fmt: skip
    model = GPT(gcfg)
    random_model = GPT(gcfg).eval()  # same init distribution, untrained: the probe control
    tr = train(model, train_set, test, cfg.train, run, cfg.seed)
    model.to(run.device).eval()
    random_model.to(run.device)

    def final_eval() -> dict:
        m = evaluate(model, test, clean_all, noisy, run.device)
        hard = [i for i, it in enumerate(test_items) if cascading_carry(it)]
        hard_em = answer_matches(model, test.ids[hard], test.select(torch.tensor(hard))).all(1).float().mean().item() if hard else float("nan")
        return {**asdict(m), "cascading_carry_test_em": hard_em, "n_cascading": len(hard),
                "steps": tr.step, "train_seconds": round(tr.seconds, 1)}  # fmt: skip

    final = run.stage("final_eval", final_eval)
    run.save_json("analysis/final_eval.json", final)

    n_probe = min(cfg.analysis.probe_items, len(clean_items))
    probe_items = clean_items[:n_probe]
    probe_set = clean_all.select(torch.arange(n_probe))
    an = cfg.analysis

    def stage(name: str, fn):
        result = run.stage(name, fn)
        run.save_json(f"analysis/{name}.json", result)
        return result

    stage("logit_lens", lambda: A.run_logit_lens(model, noisy))
    stage("lens_over_training", lambda: A.run_lens_over_training(model, run.checkpoints("snapshots"), noisy))
    probes = stage("probes", lambda: A.run_probes(model, random_model, probe_set, probe_items, test, test_items,
                                                  noisy, noisy_items, cfg.seed))  # fmt: skip
    inlp_res = stage("inlp", lambda: A.run_inlp(model, probes, probe_set, probe_items, test, noisy, an.inlp_iters,
                                                cfg.seed))  # fmt: skip

    def circuits() -> dict:
        summary, scores = A.run_circuits(model, clean_all, noisy, an.circuit_top_frac, an.circuit_items, cfg.seed)
        return {**summary, "memorization_scores": scores}

    circ = stage("circuits", circuits)
    layer = an.neuron_layer % mc.n_layers
    neurons = stage("neurons", lambda: A.run_neurons(model, circ["memorization_scores"], probe_set, probe_items,
                                                     test, test_items, noisy, noisy_items, cfg.task.digit_order,
                                                     an.neuron_k, layer, cfg.seed))  # fmt: skip
    return {
        "clean_test_em": final["clean_test_em"], "clean_train_em": final["clean_train_em"],
        "noisy_memorized": final["noisy_memorized"], "noisy_true_answer": final["noisy_true_answer"],
        "cascading_carry_test_em": final["cascading_carry_test_em"],
        "probe_carry_acc_clean": probes["carry_acc_clean"], "probe_carry_acc_noisy": probes["carry_acc_noisy"],
        "probe_carry_acc_noisy_shared_prefix": probes.get("carry_acc_noisy_shared_prefix", float("nan")),
        "probe_carry_acc_random_model": probes["carry_acc_random_model"],
        "inlp_memorization_drop": inlp_res["memorization_drop"], "inlp_random_drop": inlp_res["random_memorization_drop"],
        "inlp_clean_drop": inlp_res["clean_drop"], "inlp_random_clean_drop": inlp_res["random_clean_drop"],
        "circuit_iou": circ["iou"], "circuit_iou_random": circ["iou_random_baseline"],
        "circuit_faithfulness_mem": circ["faithfulness_memorization"],
        "circuit_faithfulness_gen": circ["faithfulness_generalization"],
        "neuron_patch_restore_rate": neurons["restore_rate"],
        "neuron_patch_restore_rate_random": neurons["restore_rate_random"],
        "neuron_z_noisy": neurons["z_noisy_abs"], "neuron_z_clean": neurons["z_clean_abs"],
        "steps": final["steps"], "train_seconds": final["train_seconds"],
        "n_noisy": len(noisy_items), "n_train": len(train_items),
    }  # fmt: skip


def report_sections(run_dir: Path):
    from reprlab.methods.reason_to_rote.report import fda_sections

    return fda_sections(Path(run_dir))
