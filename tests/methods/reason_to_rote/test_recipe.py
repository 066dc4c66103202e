"""End-to-end recipe runs on tiny settings (slow on the shared 2-core machine, so marked slow)."""

import json
import math

import pytest

from reprlab.cli import execute

FDA_TINY = [
    "train.steps=40",
    "train.eval_every=20",
    "task.n_train=400",
    "task.n_test=100",
    "analysis.probe_items=200",
    "analysis.circuit_items=20",
    "model.d_model=32",
    "model.d_mlp=64",
]
SUMMARY_KEYS = [
    "clean_test_em",
    "noisy_memorized",
    "noisy_true_answer",
    "probe_carry_acc_clean",
    "probe_carry_acc_noisy",
    "inlp_memorization_drop",
    "inlp_random_drop",
    "circuit_iou",
    "neuron_patch_restore_rate",
]


@pytest.mark.slow
def test_fda_recipe_end_to_end_and_resume(tmp_path):
    out = execute("rote-fda-tiny", FDA_TINY, out=tmp_path / "run", quiet=True)
    summary = json.loads((out / "summary.json").read_text())
    for key in SUMMARY_KEYS:
        assert key in summary and math.isfinite(summary[key]), key
    for name in ("logit_lens", "probes", "inlp", "circuits", "neurons"):
        assert (out / "analysis" / f"{name}.json").exists()
    assert (out / "report.md").exists()
    # resuming a finished run reads every stage back and reproduces the summary
    again = execute("rote-fda-tiny", FDA_TINY, out=tmp_path / "run", resume=True, quiet=True)
    summary2 = json.loads((again / "summary.json").read_text())
    assert {k: summary2[k] for k in SUMMARY_KEYS} == {k: summary[k] for k in SUMMARY_KEYS}


@pytest.mark.slow
def test_thr_recipe_end_to_end(tmp_path):
    out = execute(
        "rote-thr-tiny",
        ["train.steps=20", "train.eval_every=10", "task.n_people=30", "task.n_orgs=6"],
        out=tmp_path / "thr",
        quiet=True,
    )
    summary = json.loads((out / "summary.json").read_text())
    for key in (
        "heldout_two_hop_em",
        "facts_em",
        "noisy_memorized",
        "probe_bridge_acc_noisy",
        "inlp_memorization_drop",
    ):
        assert key in summary, key


def test_fda_zero_noise_runs_without_noisy_items(tmp_path):
    # the old recipe raised ValueError when noise_rate=0; now it trains and reports dynamics + final eval
    import torch

    before = torch.get_num_threads()
    threads = 2 if before != 2 else 1  # a count other than the caller's
    out = execute("rote-fda-tiny", [*FDA_TINY[:3], "task.n_test=50", "task.n_val=0", "task.noise_rate=0.0",
                                    "model.d_model=32", "model.d_mlp=64", f"threads={threads}"],
                  out=tmp_path / "z", quiet=True)  # fmt: skip
    # env.json records the run's own thread count (it recorded the caller's), and the caller's comes back after
    assert json.loads((out / "env.json").read_text())["torch_threads"] == threads
    assert torch.get_num_threads() == before
    summary = json.loads((out / "summary.json").read_text())
    assert summary["n_train"] == 400 and summary["control"] == 0 and "noisy_memorized" not in summary
    # every declared claim needs noisy items, so each is "n/a" (not measured), never silently true or false
    rows = json.loads((out / "claims.json").read_text())["claims"]
    assert rows and {r["verdict"] for r in rows} == {"n/a"}
    assert not [k for k in summary if k.startswith("claims.")]


@pytest.mark.slow
def test_fda_control_model_trains_on_true_labels(tmp_path):
    out = execute(
        "rote-fda-tiny", [*FDA_TINY, "control=true", "task.n_val=50"], out=tmp_path / "c", quiet=True
    )
    summary = json.loads((out / "summary.json").read_text())
    assert (
        summary["control"] == 1 and summary["n_noisy"] == 20
    )  # 5% of 400 items, analysed but never trained on
    for key in ("circuit_iou_null_unrelated", "neuron_restore_gain_net", "probe_carry_selectivity"):
        assert math.isfinite(summary[key]), key


def test_sweep_curves_section_has_one_panel_per_seed(tmp_path):
    from reprlab.methods.reason_to_rote.report import sweep_curves_section

    for s in (0, 1):
        d = tmp_path / f"seed-{s}"
        d.mkdir()
        rows = [{"step": k * 100, "clean_test_em": 0.5, "noisy_memorized": 0.1 * k, "noisy_true_answer": 0.2}
                for k in range(1, 4)]  # fmt: skip
        (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    sec = sweep_curves_section(sorted(tmp_path.glob("seed-*")))
    assert [ax.get_title() for ax in sec.figure.axes] == ["seed-0", "seed-1"]
    assert sweep_curves_section([tmp_path / "missing"]) is None


@pytest.mark.slow
def test_fda_recipe_permuted_null(tmp_path):
    # with the other optional stages on: each must add its summary keys without dropping the others'
    opts = ["analysis.permuted_null=true", "analysis.edge_circuits=true", "analysis.head_ablation=true"]
    out = execute("rote-fda-tiny", [*FDA_TINY, *opts], out=tmp_path / "run", quiet=True)
    summary = json.loads((out / "summary.json").read_text())
    for key in (
        "circuit_iou_null_permuted",
        "circuit_iou_excess_permuted",
        "permuted_model_train_em",
        "edge_circuit_iou_excess",
        "head_ablation_corr_excess",
    ):
        assert key in summary and math.isfinite(summary[key]), key
    assert (
        summary["circuit_iou_excess_permuted"]
        == summary["circuit_iou"] - summary["circuit_iou_null_permuted"]
    )
    pn = json.loads((out / "analysis" / "circuits_permuted_null.json").read_text())
    assert pn["steps"] == summary["steps"]  # as many steps as the real run
    # the claim reads the permuted null's keys: evaluated once its precondition holds (40 steps memorise too
    # little for it, so the run's own verdict is n/a), never n/a for a missing key
    from reprlab.recipes import get_recipe
    from reprlab.results.claims import evaluate_claims

    claim = next(c for c in get_recipe("rote-fda-tiny").claims() if c.name == "shared_circuit_vs_permuted")
    (result,) = evaluate_claims([claim], {**summary, "noisy_memorized": 1.0})
    assert result.verdict in ("holds", "does not hold"), result


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_fda_recipe_on_a_hf_model_from_its_config_resumes_and_exports(tmp_path, kind):
    # a tiny HF architecture from a config folder (no download) through the whole recipe, every optional stage
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    from reprlab.methods.reason_to_rote.dataset import Vocab, load_dataset, tensorize
    from reprlab.methods.reason_to_rote.evaluate import answer_matches
    from reprlab.models.hf_lm import HFCausalLM

    folder = tmp_path / kind
    if kind == "llama":
        LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=32).save_pretrained(folder)  # fmt: skip
    else:
        GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4, n_inner=64,
                   bos_token_id=0, eos_token_id=0).save_pretrained(folder)  # fmt: skip
    from tests.unit.models.test_model_files import _tokenizer

    _tokenizer(folder, chat=False)  # a tokenizer the model, built with the task's ids, must not be saved with
    opts = [f"model.hf_id={folder}", "model.from_config=true", "analysis.permuted_null=true",
            "analysis.edge_circuits=true", "analysis.head_ablation=true", "analysis.probe_layer_every=2"]  # fmt: skip
    out = execute("rote-fda-tiny", [*FDA_TINY, *opts], out=tmp_path / "run", quiet=True)
    summary = json.loads((out / "summary.json").read_text())
    for key in [
        *SUMMARY_KEYS,
        "circuit_iou_null_permuted",
        "edge_circuit_iou_excess",
        "head_ablation_corr_excess",
    ]:
        assert key in summary and math.isfinite(summary[key]), key
    info = json.loads((out / "analysis" / "model.json").read_text())
    assert info["architecture"] == {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel"}[kind]
    probes = json.loads((out / "analysis" / "probes.json").read_text())
    assert probes["layers"] == ["embed", "block1"]  # probe_layer_every=2: the embedding and the last block
    # the exported model loads with transformers and gives the run's final clean test EM
    hf = AutoModelForCausalLM.from_pretrained(out / "model").eval()
    # the task vocabulary's ids (from_config): no tokenizer beside the model, which it would not fit
    assert not list((out / "model").glob("tokenizer*"))
    ds = load_dataset(out / "data")
    test = tensorize(ds.splits["test"], Vocab(ds.manifest["vocab"], ds.manifest["tokenizer"]))
    with torch.no_grad():
        em = answer_matches(HFCausalLM(hf), test.ids, test).all(1).float().mean().item()
    assert em == summary["clean_test_em"]
    again = execute("rote-fda-tiny", [*FDA_TINY, *opts], out=tmp_path / "run", resume=True, quiet=True)
    summary2 = json.loads((again / "summary.json").read_text())
    assert {k: summary2[k] for k in SUMMARY_KEYS} == {k: summary[k] for k in SUMMARY_KEYS}


def test_dynamics_text_says_only_what_the_curves_show():
    """The report's sentence on the training curves: 'then memorisation takes over' only when the memorised share
    ends above the true-answer rate after its peak; a run that memorises nothing says so (it used to claim the
    pattern whatever the curves showed)."""
    from reprlab.methods.reason_to_rote.report import _dynamics_words

    def rows(true, mem):
        return [
            {"step": 100 * i, "noisy_true_answer": t, "noisy_memorized": m}
            for i, (t, m) in enumerate(zip(true, mem))
        ]

    text = _dynamics_words(rows([0.1, 0.6, 0.3, 0.1], [0.0, 0.1, 0.5, 0.8]))
    assert "peaks at 0.600 (step 100)" in text and "overtakes" in text and "generalise-then-memorise" in text
    text = _dynamics_words(rows([0.1, 0.5, 0.9, 0.975], [0.0, 0.0, 0.0, 0.0]))
    assert (
        "at the last evaluation" in text and "no noisy label is memorised" in text and "overtakes" not in text
    )
    text = _dynamics_words(rows([0.1, 0.6, 0.5], [0.0, 0.1, 0.2]))
    assert "overtakes" not in text and "ends at 0.200 (step 200), below the true-answer rate" in text


def test_the_report_says_what_ran_and_when_its_mechanism_numbers_say_nothing(tmp_path):
    """The report opens with the task, the noise and the model from the run's config; a run that memorised under
    half of its noisy labels (the demo stops in the generalisation phase) says its mechanism numbers are measured
    on a model that has not memorised, and a run that memorised does not."""
    import json

    import yaml

    from reprlab.methods.reason_to_rote.report import setup_text

    cfg = {"task": {"n_train": 4000, "n_test": 1000, "noise_rate": 0.05},
           "model": {"hf_id": "", "n_layers": 2, "d_model": 64, "n_heads": 4}, "train": {"steps": 10000, "max_steps": 2000}}  # fmt: skip
    (tmp_path / "config.yaml").write_text("# recipe: rote-fda-tiny\n" + yaml.safe_dump(cfg))
    for memorised, warned in ((0.0, True), (0.93, False)):
        (tmp_path / "summary.json").write_text(json.dumps({"noisy_memorized": memorised}))
        text = setup_text(tmp_path, "four-digit addition (FDA)")
        assert "4,000 training items" in text and "5 % of training labels noisy" in text
        assert "our GPT (2 layers, d_model 64, 4 heads)" in text and "at most 2,000 training steps" in text
        assert ("has not memorised" in text) is warned, text
