"""rote-fda-*: Reason to Rote on four-digit addition with noisy labels, trained from scratch, then analysed.

Objective: reproduce, qualitatively, the analyses of Du et al., *Reason to Rote: Rethinking Memorization in
Reasoning* (EMNLP 2025, arXiv 2507.04782) on a small GPT: generalise-then-memorise dynamics, the true
answer decodable under a memorised noisy label (logit lens), intermediate results (carries) still computed
on noisy items (probes), memorisation depending on them (INLP with a random control), overlap of the
memorisation and generalisation circuits (node attribution patching), and outlier-heuristic neurons
(z-scores and patch-back).

Paper vs ours: the tasks, the analyses and their names are the paper's; every format, size, architecture,
hyper-parameter, layer/position choice and summary statistic here is **[ours]** (the paper's are unknown
to us; ``docs/reason_to_rote.md`` lists every choice). Circuits are node-level (the paper uses edges).

Pipeline (each step a resumable stage): data -> train (checkpoints, dynamics; stops once memorised *and*
generalised on a clean validation split) -> final eval -> dynamics summary -> logit lens -> probes -> INLP ->
circuits [-> edge circuits, head ablation: options] -> neurons -> summary. ``report_sections`` plots from
the saved artefacts.

Matched nulls [ours; see ``docs/reason_to_rote.md``]: probes are scored only at leak-free cells
(both digit orders) chosen on a split disjoint from the reported one, against the same probe on an untrained
model; circuit overlap against circuits of unrelated metrics at the same items and positions; neuron
patch-back as a gain over the pre-patch rate, net of random and attribution-matched neurons; and
``control=true``, the 0%-noise model of the same seed (true labels everywhere; the noisy items keep their
noisy labels for the analyses only).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from reprlab.errors import ConfigError
from reprlab.hooks import n_layers
from reprlab.jsonfile import null_as_nan
from reprlab.methods.reason_to_rote import analyses as A
from reprlab.methods.reason_to_rote.dataset import Batch, Vocab, load_dataset, tensorize
from reprlab.methods.reason_to_rote.evaluate import answer_matches, evaluate
from reprlab.methods.reason_to_rote.fda import FDAConfig, cascading_carry, generate_fda, validate_fda_item
from reprlab.methods.reason_to_rote.lm import LM, HFOptions, build_lm, preflight_lm, save_lm
from reprlab.methods.reason_to_rote.train import TrainConfig, run_dist, train
from reprlab.models.gpt import GPT, GPTConfig
from reprlab.report.headline import Headline
from reprlab.train.dist import main_first
from reprlab.train.seed import seed_everything


@dataclass(frozen=True)
class ModelConfig(HFOptions):
    """Our GPT's size [ours] (d_vocab and n_ctx are set from the task), or a HF causal LM (``hf_id``)."""

    n_layers: int = field(default=2, metadata={"help": "transformer blocks", "ge": 1})
    d_model: int = field(default=64, metadata={"help": "residual stream width", "ge": 1})
    n_heads: int = field(default=4, metadata={"help": "attention heads (must divide d_model)", "ge": 1})
    d_mlp: int = field(default=256, metadata={"help": "MLP hidden width", "ge": 1})

    def __post_init__(self) -> None:
        # the GPT sizes do not apply to a HF model, so they are not checked against each other then
        if not self.hf_id and self.n_heads >= 1 and self.d_model % self.n_heads:
            fits = [h for h in range(1, self.d_model + 1) if self.d_model % h == 0]
            raise ConfigError(f"model.n_heads={self.n_heads} must divide model.d_model={self.d_model}; use one of "
                              f"{fits} or change model.d_model")  # fmt: skip


@dataclass(frozen=True)
class AnalysisConfig:
    """Analysis settings [ours]."""

    probe_items: int = field(default=1500, metadata={"help": "clean training items used to fit probes"})
    inlp_iters: int = field(default=8, metadata={"help": "max INLP classifiers removed per carry"})
    circuit_items: int = field(default=200, metadata={"help": "items per circuit"})
    circuit_top_frac: float = field(default=0.02, metadata={"help": "share of nodes kept in a circuit"})
    neuron_k: int = field(default=16, metadata={"help": "top neurons patched back"})
    neuron_layer: int = field(default=-1, metadata={"help": "MLP layer for the neuron analysis (-1 = last)"})
    neuron_random_draws: int = field(default=5, metadata={"help": "draws of each random-neuron control"})
    circuit_nulls: int = field(default=3, metadata={"help": "unrelated-metric circuits (the IoU null)"})
    head_ablation: bool = field(
        default=False, metadata={"help": "also mean-ablate each head (with the same null)"}
    )
    edge_circuits: bool = field(
        default=False, metadata={"help": "also build edge circuits (EAP) with the same nulls"}
    )
    edge_top_frac: float = field(default=0.2, metadata={"help": "share of edges kept in an edge circuit"})
    permuted_null: bool = field(
        default=False,
        metadata={"help": "also train a label-permuted model (same init, batches and steps; every item gets "
                          "another item's answer) and compare circuit IoUs with it on the same items [ours]; "
                          "doubles the training time"},
    )  # fmt: skip
    permuted_steps: int = field(
        default=0,
        metadata={"help": "steps of the label-permuted model (0 = as many as the real run took)", "ge": 0},
    )
    edge_ig_steps: int = field(
        default=0, metadata={"help": "integrated-gradient steps for EAP-IG (0 = plain EAP)"}
    )
    probe_layer_every: int = field(
        default=1,
        metadata={"help": "probe the embedding, every k-th block and the last (1 = every block; deep HF "
                          "models: each residual stream costs 2 x 9 probe fits per position)", "ge": 1},
    )  # fmt: skip
    mean_items: int = field(
        default=1000, metadata={"help": "clean items whose mean activations mean-ablation uses", "ge": 1}
    )


@dataclass(frozen=True)
class Config:
    seed: int = field(default=0, metadata={"help": "seed for data, init and batch order"})
    device: str = field(default="auto", metadata={"help": "auto | cpu | cuda"})
    threads: int = field(default=0, metadata={"help": "torch CPU threads (0 = torch's default)"})
    control: bool = field(default=False, metadata={
        "help": "0%-noise control [ours]: train on the true label of every item; the items that the same seed "
                "makes noisy keep their noisy labels for the analyses only (the matched null of every column)"})  # fmt: skip
    task: FDAConfig = field(default_factory=FDAConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    analysis: AnalysisConfig = field(default_factory=AnalysisConfig)


def _load_data(cfg: Config, run):
    folder = run.dir / "data"
    run_dist(run)  # under torchrun: join the ranks; rank 0 writes the data, the others read the stage back
    save = lambda: (generate_fda(cfg.task, cfg.seed).save(folder), {"folder": "data"})[1]  # noqa: E731
    main_first(lambda: run.stage("data", save), run.is_main)
    ds = load_dataset(folder, lambda it: validate_fda_item(it, cfg.task.digit_order))
    return ds, Vocab(ds.manifest["vocab"], ds.manifest["tokenizer"])


def dynamics_summary(rows: list[dict], threshold: float = 0.5) -> dict:
    """Generalise-then-memorise statistics from the logged dynamics (``metrics.jsonl`` rows) [ours].

    ``peak_noisy_true_answer``: the highest true-answer rate on noisy items before memorisation first reaches
    ``threshold``; ``step_peak_noisy_true``: where it was; ``step_memorized_half``: the first step with
    memorisation >= ``threshold`` (absent when never reached). Generalise-then-memorise means the peak is
    high and comes first.
    """
    rows = [r for r in rows if "noisy_memorized" in r and r["noisy_memorized"] == r["noisy_memorized"]]
    if not rows:
        return {}
    half = next((r["step"] for r in rows if r["noisy_memorized"] >= threshold), None)
    before = [r for r in rows if half is None or r["step"] < half] or rows[:1]
    peak = max(before, key=lambda r: r["noisy_true_answer"])
    out = {"peak_noisy_true_answer": peak["noisy_true_answer"], "step_peak_noisy_true": peak["step"]}
    if half is not None:
        out["step_memorized_half"] = half
    return out


def _metrics_rows(run) -> list[dict]:
    """metrics.jsonl rows; a rate that was NaN (no noisy items) is written as null and read back as NaN."""
    path = run.dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [null_as_nan(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def _neuron_layer(index: int, n: int, source: str) -> int:
    """``analysis.neuron_layer`` as a block index, Python-style (-1 = last); ``source`` says where ``n`` came
    from. Out of range is an error: wrapping it modulo the depth would analyse a layer nobody asked for."""
    if not -n <= index < n:
        raise ConfigError(f"analysis.neuron_layer={index} is out of range for a model with {n} layers "
                          f"({source}); use 0..{n - 1}, or -{n}..-1 counting from the last")  # fmt: skip
    return index % n


def preflight(cfg: Config) -> None:
    """Fail before the run folder exists when the config cannot give noisy items to analyse, names a HF
    model that is not available offline, or a neuron layer our GPT does not have."""
    if cfg.model.hf_id:
        depth = preflight_lm(
            cfg.model, generate_fda(cfg.task, cfg.seed)
        )  # on the run's own (deterministic) data
        if depth is not None:  # a GGUF's depth is known once loaded: run() checks it there, before training
            _neuron_layer(cfg.analysis.neuron_layer, depth, f"model.hf_id={cfg.model.hf_id!r}")
    else:
        _neuron_layer(cfg.analysis.neuron_layer, cfg.model.n_layers, "model.n_layers")
    if cfg.control and round(cfg.task.noise_rate * cfg.task.n_train) == 0:
        raise ConfigError("control=true needs task.noise_rate > 0: the noisy items are what the control is "
                          "compared on (it trains on their true labels)")  # fmt: skip


def run(cfg: Config, run) -> dict:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    seed_everything(cfg.seed)
    ds, vocab = _load_data(cfg, run)
    train_items, test_items = ds.splits["train"], ds.splits["test"]
    train_set, test = tensorize(train_items, vocab), tensorize(test_items, vocab)
    val = tensorize(ds.splits["val"], vocab) if "val" in ds.splits else None
    clean_items = [it for it in train_items if not it.noisy]
    noisy_items = [it for it in train_items if it.noisy]
    clean_all = tensorize(clean_items, vocab)
    noisy = tensorize(noisy_items, vocab) if noisy_items else None

    mc = cfg.model
    lm: LM | None = None
    if mc.hf_id:  # a HF causal LM behind our GPT's call; every batch in its token ids
        lm = build_lm(
            mc.hf_id, mc.from_config, mc.tokens, vocab, train_set.ids.shape[1], cfg.seed, run.device
        )
        train_set, test, clean_all = lm.remap(train_set), lm.remap(test), lm.remap(clean_all)
        val, noisy = (lm.remap(b) if b is not None else None for b in (val, noisy))
        model, random_model = lm.model, None  # the untrained control is built when the probes need it
        run.save_json("analysis/model.json", lm.info)
    else:
        torch.manual_seed(cfg.seed)
        gcfg = GPTConfig(d_vocab=len(vocab), n_ctx=train_set.ids.shape[1], n_layers=mc.n_layers, d_model=mc.d_model,
                         n_heads=mc.n_heads, d_mlp=mc.d_mlp)  # fmt: skip
        model = GPT(gcfg)
        random_model = GPT(gcfg).eval()  # same init distribution, untrained: the probe control
    source = f"model.hf_id={mc.hf_id!r}" if mc.hf_id else "model.n_layers"
    layer = _neuron_layer(cfg.analysis.neuron_layer, n_layers(model), source)
    if cfg.control:  # true labels everywhere; track the (never seen) noisy labels of the same items
        fit_set = Batch(train_set.ids_true, train_set.ids_true, train_set.answer_start, train_set.answer_len,
                        torch.zeros_like(train_set.noisy))  # fmt: skip
        tr = train(
            model, fit_set, test, cfg.train, run, cfg.seed, val=val, eval_noisy=noisy, dist=run_dist(run)
        )
    else:
        tr = train(model, train_set, test, cfg.train, run, cfg.seed, val=val, dist=run_dist(run))
    model.to(run.device).eval()
    if random_model is not None:
        random_model.to(run.device)
    if lm is not None:
        run.stage("export", lambda: save_lm(lm, run.dir / "model"))

    def final_eval() -> dict:
        m = evaluate(model, test, clean_all, noisy if noisy is not None else clean_all, run.device)
        hard = [i for i, it in enumerate(test_items) if cascading_carry(it)]
        hard_em = (
            answer_matches(model, test.ids[hard], test.select(torch.tensor(hard)))
            .all(1)
            .float()
            .mean()
            .item()
            if hard
            else float("nan")
        )
        return {**asdict(m), "cascading_carry_test_em": hard_em, "n_cascading": len(hard),
                "steps": tr.step, "train_seconds": round(tr.seconds, 1), "stopped_early": tr.stopped_early}  # fmt: skip

    final = run.stage("final_eval", final_eval)
    run.save_json("analysis/final_eval.json", final)
    dyn = run.stage("dynamics", lambda: dynamics_summary(_metrics_rows(run)))
    head = {
        "clean_test_em": final["clean_test_em"], "clean_train_em": final["clean_train_em"],
        "cascading_carry_test_em": final["cascading_carry_test_em"], **dyn,
        "steps": final["steps"], "stopped_early": int(final["stopped_early"]),
        "train_seconds": final["train_seconds"], "n_train": len(train_items), "control": int(cfg.control),
    }  # fmt: skip
    if noisy is None:  # 0% noise without control: nothing to compare memorisation on
        run.logger.info("no noisy items (task.noise_rate=0): dynamics and final evaluation only")
        return head

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
    digits = lm.token_map[:10] if lm is not None else None  # model ids of 0..9 (FDA_VOCAB starts with them)
    probes = stage("probes", lambda: A.run_probes(model, random_model if lm is None else lm.untrained(), probe_set, probe_items,
                                                  test, test_items, noisy, noisy_items, cfg.seed,
                                                  cfg.task.digit_order, an.probe_layer_every))  # fmt: skip
    inlp_res = stage("inlp", lambda: A.run_inlp(model, probes, probe_set, probe_items, test, noisy, an.inlp_iters,
                                                cfg.seed))  # fmt: skip

    def circuits() -> dict:
        summary, scores = A.run_circuits(model, clean_all, noisy, an.circuit_top_frac, an.circuit_items, cfg.seed,
                                         an.circuit_nulls, digits, an.mean_items)  # fmt: skip
        return {**summary, "memorization_scores": scores}

    circ = stage("circuits", circuits)
    extra_keys = {}
    if an.permuted_null:

        def permuted() -> dict:
            # [ours] same init (re-seeded), same batch order and schedule as the real model, labels permuted;
            # trained inside this stage without checkpoints: an interrupted run redoes the stage on resume
            if lm is not None:
                null_model = lm.fresh()
            else:
                torch.manual_seed(cfg.seed)
                null_model = GPT(gcfg)
            steps = an.permuted_steps or tr.step
            tcfg = replace(cfg.train, max_steps=steps, stop_memorized=1.01, snapshot_every=0,
                           eval_every=max(steps, 1))  # fmt: skip
            fit = A.permute_labels(train_set, cfg.seed)
            ptr = train(null_model, fit, test, tcfg, _StageRun(run), cfg.seed)
            null_model.to(run.device).eval()
            summary, _ = A.run_circuits(null_model, clean_all, noisy, an.circuit_top_frac, an.circuit_items,
                                        cfg.seed, an.circuit_nulls, digits, an.mean_items)  # fmt: skip
            own = answer_matches(null_model, fit.ids.to(run.device), fit).all(1).float().mean().item()
            return {**A.permuted_null_summary(circ, summary), "steps": ptr.step,
                    "train_em_permuted_labels": own, "test_em": ptr.final.get("clean_test_em", float("nan")),
                    "circuits": summary}  # fmt: skip

        pn = stage("circuits_permuted_null", permuted)
        extra_keys |= {
            "circuit_iou_null_permuted": pn["iou_null_permuted"], "circuit_iou_excess_permuted": pn["iou_excess_permuted"],
            "permuted_model_train_em": pn["train_em_permuted_labels"], "permuted_model_test_em": pn["test_em"],
        }  # fmt: skip
    if an.edge_circuits:
        ec = stage("edge_circuits", lambda: A.run_edge_circuits(model, clean_all, noisy, an.edge_top_frac,
                                                                an.circuit_items, cfg.seed, an.circuit_nulls,
                                                                an.edge_ig_steps, digits, an.mean_items))  # fmt: skip
        extra_keys |= {"edge_circuit_iou": ec["iou"], "edge_circuit_iou_null_unrelated": ec["iou_null_unrelated"],
                     "edge_circuit_faithfulness_mem": ec["faithfulness_memorization"],
                     "edge_circuit_faithfulness_gen": ec["faithfulness_generalization"],
                     "edge_circuit_iou_excess": ec["iou"] - ec["iou_null_unrelated"]}  # fmt: skip
    if an.head_ablation:
        ha = stage("head_ablation", lambda: A.run_head_ablation(model, clean_all, noisy, an.circuit_items, cfg.seed,
                                                                an.circuit_nulls, digits, an.mean_items))  # fmt: skip
        extra_keys |= {
            "head_ablation_corr": ha["corr"],
            "head_ablation_corr_null_unrelated": ha["corr_null_unrelated"],
            "head_ablation_corr_excess": ha["corr"] - ha["corr_null_unrelated"],
        }
    neurons = stage("neurons", lambda: A.run_neurons(model, circ["memorization_scores"], probe_set, probe_items,
                                                     test, test_items, noisy, noisy_items, cfg.task.digit_order,
                                                     an.neuron_k, layer, cfg.seed, an.neuron_random_draws))  # fmt: skip
    return {
        **head,
        "noisy_memorized": final["noisy_memorized"], "noisy_true_answer": final["noisy_true_answer"],
        "probe_carry_acc_clean": probes["carry_acc_clean"], "probe_carry_acc_noisy": probes["carry_acc_noisy"],
        "probe_carry_acc_noisy_shared_prefix": probes.get("carry_acc_noisy_shared_prefix", float("nan")),
        "probe_carry_acc_random_model": probes["carry_acc_random_model"],
        "probe_carry_acc_shuffled": probes["carry_acc_shuffled"],
        "probe_carry_selectivity": probes["carry_selectivity"],
        "inlp_memorization_drop": inlp_res["memorization_drop"], "inlp_random_drop": inlp_res["random_memorization_drop"],
        "inlp_clean_drop": inlp_res["clean_drop"], "inlp_random_clean_drop": inlp_res["random_clean_drop"],
        "circuit_iou": circ["iou"], "circuit_iou_random": circ["iou_random_baseline"],
        "circuit_iou_null_unrelated": circ["iou_null_unrelated"],
        "circuit_iou_null_unrelated_pair": circ["iou_null_unrelated_pair"],
        "circuit_iou_excess": circ["iou_excess"],
        "circuit_faithfulness_mem": circ["faithfulness_memorization"],
        "circuit_faithfulness_gen": circ["faithfulness_generalization"],
        "circuit_faithfulness_mem_with_gen": circ["faithfulness_memorization_with_generalization_circuit"],
        "neuron_patch_restore_rate": neurons["restore_rate"],
        "neuron_patch_restore_rate_random": neurons["restore_rate_random"],
        "neuron_patch_restore_rate_random_matched": neurons["restore_rate_random_matched"],
        "neuron_true_before": neurons["true_before"],
        "neuron_restore_gain": neurons["restore_gain"], "neuron_restore_gain_net": neurons["restore_gain_net"],
        "neuron_z_noisy": neurons["z_noisy_abs"], "neuron_z_clean": neurons["z_clean_abs"],
        "n_noisy": len(noisy_items), **extra_keys,
    }  # fmt: skip


class _StageRun:
    """A :class:`~reprlab.runs.Run` stand-in for training a null model inside one stage: dynamics are kept in
    memory (not in ``metrics.jsonl``, whose steps belong to the main model) and no checkpoints are written."""

    def __init__(self, run):
        self._run, self.device, self.logger, self.resume = run, run.device, run.logger, False
        self.rows: list[dict] = []

    def log(self, step: int, **metrics) -> None:
        self.rows.append({"step": step, **metrics})

    def save_checkpoint(self, *args, **kwargs) -> None:
        return None

    def load_checkpoint(self, *args, **kwargs) -> None:
        return None

    def progress(self, iterable, total=None, desc=""):
        return self._run.progress(iterable, total=total, desc=f"{desc} (label-permuted null)")


# Shares of items (exact match, probe accuracy, restoration rates) and circuit overlaps (IoU, in [0, 1]) get
# Wilson intervals over seeds; drops, gains, z-scores and faithfulness are differences or ratios: t intervals.
SUMMARY_KINDS = {
    "*_em": "proportion", "noisy_memorized": "proportion", "noisy_true_answer": "proportion",
    "peak_noisy_true_answer": "proportion", "probe_carry_acc_*": "proportion", "neuron_patch_restore_rate*": "proportion",
    "neuron_true_before": "proportion", "circuit_iou": "proportion", "circuit_iou_null_*": "proportion",
    "circuit_iou_random": "proportion", "edge_circuit_iou": "proportion", "edge_circuit_iou_null_*": "proportion",
}  # fmt: skip
HEADLINE = (
    Headline(rows=(("clean test exact match", "clean_test_em"), ("noisy labels memorised", "noisy_memorized"),
                   ("true answer on noisy items, at its peak", "peak_noisy_true_answer"),
                   ("training steps", "steps")), caption="Generalise, then memorise"),
    Headline(rows=(("carries decoded on noisy items", "probe_carry_acc_noisy_shared_prefix"),
                   ("  … by the same probe on an untrained model", "probe_carry_acc_random_model"),
                   ("memorisation drop, carry subspaces removed (INLP)", "inlp_memorization_drop"),
                   ("  … random subspaces of the same ranks", "inlp_random_drop"),
                   ("memorisation-generalisation circuit overlap (IoU)", "circuit_iou"),
                   ("  … with circuits of unrelated metrics", "circuit_iou_null_unrelated"),
                   ("top-neuron patching: net restoration gain", "neuron_restore_gain_net")),
             caption="Mechanism, each against its null"),
)  # fmt: skip


def report_sections(run_dir: Path):
    from reprlab.methods.reason_to_rote.report import fda_sections

    return fda_sections(Path(run_dir))


def sweep_sections(run_dirs: list[Path]):
    """Extra sections of a seed sweep's report: every seed's training dynamics side by side."""
    from reprlab.methods.reason_to_rote.report import sweep_curves_section

    sec = sweep_curves_section([Path(d) for d in run_dirs])
    return [sec] if sec is not None else []
