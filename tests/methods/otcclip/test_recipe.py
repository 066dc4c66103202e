"""otcclip-mosaic-tiny end to end on a miniature config: summary keys, report, resume from stages/checkpoints."""

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from reprlab.config import load_config
from reprlab.methods.otcclip import recipe
from reprlab.methods.otcclip.config import DEFAULT_DEFENSES
from reprlab.report.render import fmt
from reprlab.runs import Run

YAML = Path(recipe.__file__).parent / "recipes" / "otcclip-mosaic-tiny.yaml"
MINI = [
    "data.n_pairs=160",
    "data.captions_per_target=4",
    "data.n_targets=2",
    "data.backdoor_pairs=8",
    "data.n_eval=60",
    "data.n_probe_train=60",
    "train.epochs=2",
    "train.batch_size=20",
    "model.width=32",
    "model.text_width=32",
    "model.layers=1",
    "model.text_layers=1",
    "defense.rematch_warmup=1",
    "defense.rematch_every=1",
    "defense.safeclip_unimodal_epochs=0",
    "defense.ot.n_iters=10",
    "defense.bank_size=64",
]


def _cfg(extra=()):
    return load_config(recipe.Config, yaml.safe_load(YAML.read_text())["config"], [*MINI, *extra])


def test_every_shipped_otcclip_recipe_loads_with_its_demo_overrides():
    for path in YAML.parent.glob("*.yaml"):
        spec = yaml.safe_load(path.read_text())
        assert spec["entry"] == "reprlab.methods.otcclip.recipe"
        assert path.read_text().startswith(f"# reprlab run {path.stem}")
        load_config(recipe.Config, spec["config"], spec.get("demo", []))


@pytest.mark.slow
def test_otcclip_mosaic_tiny_end_to_end_and_resume(tmp_path):
    cfg = _cfg()
    run = Run.create(tmp_path / "r", cfg, "otcclip-mosaic-tiny", quiet=True)
    summary = recipe.run(cfg, run)

    # the summary is the final evaluation, and the re-matching/split diagnostics are those of the last
    # matching epoch logged in metrics.jsonl (a consistency check; values are tested on planted problems)
    results = json.loads((run.dir / "analysis" / "results.json").read_text())
    for d in DEFAULT_DEFENSES:
        for m in ("asr_targeted", "asr_backdoor", "zeroshot_acc", "linear_probe_acc"):
            assert summary[f"{d}.{m}"] == results[d][m]
    log = [json.loads(line) for line in (run.dir / "metrics.jsonl").read_text().splitlines()]
    last_match = [r for r in log if r.get("defense") == "otcclip" and r["phase"] == "otc_match"][-1]
    for k in ("rematch_poison_moved", "rematch_clean_kept"):
        assert summary[f"otcclip.{k}"] == last_match[k]
    assert last_match["ot_converged_share"] > 0 and "ot_max_marginal_error" in last_match
    assert summary["audit.n_flagged"] >= 0 and "audit.ot_max_marginal_error" in summary
    sections = recipe.report_sections(run.dir)
    assert sections[0].table and len(sections[0].table) == 4 and any(s.figure is not None for s in sections)
    assert (run.dir / "audit" / "flagged.csv").exists()
    _audit_cli_on_user_files(tmp_path, run.dir)
    # resume: every defense is a finished stage, so nothing retrains and the summary is identical
    again = recipe.run(cfg, Run.create(tmp_path / "r", cfg, "otcclip-mosaic-tiny", resume=True, quiet=True))
    assert again == summary
    # a run killed during otcclip's last epoch: its stage and last checkpoint are missing; resuming from
    # the epoch-1 checkpoint (weights, optimizer, bank, RNG) must reproduce the uninterrupted result
    import shutil

    (run.dir / "stages" / "otcclip.json").unlink()
    (run.dir / "stages" / "audit.json").unlink()
    shutil.rmtree(run.checkpoints("otcclip")[-1])
    assert len(run.checkpoints("otcclip")) == 1
    resumed = recipe.run(cfg, Run.create(tmp_path / "r", cfg, "otcclip-mosaic-tiny", resume=True, quiet=True))
    for k, v in summary.items():
        if k.startswith("otcclip."):
            assert resumed[k] == pytest.approx(v, abs=1e-6), k


def _audit_cli_on_user_files(tmp_path, run_dir):
    """``reprlab otcclip audit`` on a CSV of PNG files with the run's undefended model."""
    import numpy as np
    from PIL import Image
    from typer.testing import CliRunner

    from reprlab.methods.otcclip.cli import app

    rows = ["image,caption"]
    for i, cap in enumerate(["a bag at the top left", "a photo of a sneaker", "a coat bottom right"]):
        Image.fromarray(np.full((56, 56), 60 * i, np.uint8)).save(tmp_path / f"u{i}.png")
        rows.append(f"u{i}.png,{cap}")
    rows.append("broken.png,a dress")  # missing file: counted and skipped
    (tmp_path / "user.csv").write_text("\n".join(rows) + "\n")
    res = CliRunner().invoke(
        app,
        [
            "audit",
            str(tmp_path / "user.csv"),
            "--out",
            str(tmp_path / "aud"),
            "--run",
            str(run_dir),
            "--defense",
            "none",
        ],
    )
    assert res.exit_code == 0, res.output
    assert '"data.skipped_missing_image": 1' in res.output and '"n_pairs": 3' in res.output
    assert len((tmp_path / "aud" / "flagged.csv").read_text().splitlines()) == 4
    # neither --run nor --hf-model, through the user's entry point (``reprlab otcclip audit``), whose sub-commands
    # print a ReprlabError as one line and exit 2 (the mount wraps the otcclip app's callbacks when reprlab.cli is
    # imported, so the test must not depend on whether another test imported it first)
    from reprlab.cli import app as main_app

    bad = CliRunner().invoke(main_app, ["otcclip", "audit", str(tmp_path / "user.csv")])
    assert bad.exit_code == 2 and "error: give exactly one of --run RUN" in bad.output, bad.output


def test_otcclip_claims_use_real_summary_keys_and_give_the_issue_table_verdicts():
    """Seed 0 of the ten-seed table (docs/otcclip.md): attacked, defended, but OTCCLIP's accuracy is the worst -> known verdicts."""
    from reprlab.results.claims import evaluate_claims, parse_claims

    spec = yaml.safe_load(YAML.read_text())
    claims = parse_claims(spec["claims"], str(YAML))
    metrics = ("zeroshot_acc", "linear_probe_acc", "asr_targeted", "asr_backdoor")
    rows = {
        "none": (0.567, 0.695, 1.0, 0.74),
        "roclip": (0.339, 0.554, 0.5, 0.3),
        "safeclip": (0.575, 0.644, 0.25, 0.0),
        "otcclip": (0.342, 0.422, 0.0, 0.01),
    }
    summary = {f"{d}.{m}": v for d, vals in rows.items() for m, v in zip(metrics, vals)}
    # every key a claim reads (bar the sweep-only .ci_hi ones) is one the recipe writes
    assert {k.removesuffix(".ci_hi") for c in claims for k in c.keys} <= set(summary)
    verdicts = {r.claim.name: r.holds for r in evaluate_claims(claims, summary)}
    assert verdicts == {
        "undefended_targeted_attacked": True,
        "undefended_backdoor_attacked": True,
        "otcclip_defends": True,
        "otcclip_zero_shot_best": False,
        "otcclip_linear_probe_best": False,
        "otcclip_zero_shot_within_ci": None,
        "otcclip_linear_probe_within_ci": None,
    }
    ci = {**summary, "otcclip.zeroshot_acc.ci_hi": 0.58, "otcclip.linear_probe_acc.ci_hi": 0.6}
    verdicts = {r.claim.name: r.holds for r in evaluate_claims(claims, ci)}
    assert (
        verdicts["otcclip_zero_shot_within_ci"] is True
        and verdicts["otcclip_linear_probe_within_ci"] is False
    )
    from reprlab.recipes import all_recipes

    # every otcclip recipe but otcclip-tiny has the same claims, stated or inherited (base:)
    for path in YAML.parent.glob("*.yaml"):
        if path.stem == "otcclip-tiny":  # the web-like testbed's calibration bands: tested below
            continue
        assert [c.check for c in all_recipes()[path.stem].claims()] == [c.check for c in claims], path.stem


def test_otcclip_tiny_calibration_claims_give_known_verdicts():
    """otcclip-tiny's bands on a hand-made seed: RoCLIP-style 0.02 under none in zero-shot holds (band 0.03),
    0.02 under in probe does not (band 0.01); the paired-CI claims read the paired keys the run writes."""
    from reprlab.methods.otcclip.pipeline.run import paired_differences
    from reprlab.results.claims import evaluate_claims, parse_claims

    path = YAML.parent / "otcclip-tiny.yaml"
    claims = parse_claims(yaml.safe_load(path.read_text())["claims"], str(path))
    metrics = ("zeroshot_acc", "linear_probe_acc", "asr_targeted", "asr_backdoor")
    rows = {
        "none": (0.50, 0.60, 0.75, 0.9),
        "roclip": (0.48, 0.58, 0.25, 0.0),
        "safeclip": (0.49, 0.59, 0.0, 0.0),
        "otcclip": (0.51, 0.61, 0.0, 0.05),
        "cleanclip": (0.52, 0.62, 0.5, 0.2),
    }
    results = {d: dict(zip(metrics, v)) for d, v in rows.items()}
    summary = {f"{d}.{m}": v for d, r in results.items() for m, v in r.items()}
    summary.update(paired_differences(results))
    oracle = {"oracle.asr_targeted", "oracle.asr_backdoor"}  # opt-in: the floor claim is n/a without it
    assert {k.removesuffix(".ci_hi") for c in claims for k in c.keys} - oracle <= set(summary)
    verdicts = {r.claim.name: r.holds for r in evaluate_claims(claims, summary)}
    assert verdicts == {
        "undefended_targeted_attacked": True,
        "undefended_backdoor_attacked": True,
        "roclip_keeps_zero_shot": True,
        "roclip_keeps_probe": False,
        "roclip_defends_targeted": True,
        "safeclip_keeps_accuracy": True,
        "cleanclip_removes_backdoor": False,
        "roclip_zero_shot_ci": None,
        "roclip_probe_ci": None,
        "safeclip_accuracy_ci": None,
        "otcclip_defends": True,
        "otcclip_defends_to_the_floor": None,  # the oracle did not run
        "otcclip_zero_shot_best": True,
        "otcclip_linear_probe_best": True,
        "otcclip_keeps_zero_shot": True,
        "otcclip_best_ci": None,
    }
    # with the poison-free oracle: 0.05 over its backdoor floor holds, 0.06 over does not
    for otc_backdoor, holds in ((0.05, True), (0.08, False)):
        run = dict(summary, **{"oracle.asr_targeted": 0.0, "oracle.asr_backdoor": 0.02})
        run["otcclip.asr_backdoor"] = otc_backdoor
        verdict = {r.claim.name: r.holds for r in evaluate_claims(claims, run)}
        assert verdict["otcclip_defends_to_the_floor"] is holds


def test_report_names_the_testbed_the_run_trained_on(micro_runs, tmp_path):
    """The comparison's heading names the run's testbed (it once said "mosaic" for every testbed)."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(micro_runs["otcclip-mosaic-tiny"], run_dir)
    assert recipe.report_sections(run_dir)[0].title == "OTCCLIP vs baselines on the poisoned mosaic testbed"
    data_json = run_dir / "analysis" / "data.json"
    for testbed, word in (("fashion_web", "web-like"), ("shapes", "shapes")):
        data_json.write_text(json.dumps({**json.loads(data_json.read_text()), "testbed": testbed}))
        assert (
            recipe.report_sections(run_dir)[0].title == f"OTCCLIP vs baselines on the poisoned {word} testbed"
        )
    # a run on the user's own data (streamed shards: testbed "none") is not called a testbed of ours
    data_json.write_text(json.dumps({**json.loads(data_json.read_text()), "testbed": "none"}))
    assert recipe.report_sections(run_dir)[0].title == "OTCCLIP vs baselines on your data"


def test_the_audit_reports_its_base_rate(micro_runs):
    """The audit's precision means something only beside the poisons' share of the pairs (a flag drawn at random
    has that precision): the run records both counts, consistent with its data and its precision and recall."""
    run_dir = micro_runs["otcclip-mosaic-tiny"]
    audit = json.loads((run_dir / "analysis" / "audit.json").read_text())
    data = json.loads((run_dir / "analysis" / "data.json").read_text())
    assert (
        audit["n_pairs"] == data["n_pairs"] and audit["n_poison"] == data["n_targeted"] + data["n_backdoor"]
    )
    hits = audit["precision"] * audit["n_flagged"]  # flagged poisons, read two ways
    assert hits == pytest.approx(audit["recall"] * audit["n_poison"], abs=1e-6)
    section = next(s for s in recipe.report_sections(run_dir) if s.title.startswith("Audit"))
    base = audit["n_poison"] / audit["n_pairs"]
    assert f"A flag drawn at random has precision {fmt(base)}" in section.text
    assert section.table[0]["pairs"] == data["n_pairs"]


def test_the_default_recipe_runs_all_five_defenses_on_the_web_like_pairs(tmp_path):
    """``otcclip-tiny`` (web-like pairs, all five defenses) end to end at mini sizes: every defense's headline keys,
    the testbed's alt-text noise counted, and each calibration claim given a verdict."""
    spec = yaml.safe_load((YAML.parent / "otcclip-tiny.yaml").read_text())
    mini = [o for o in MINI if not o.startswith("data.n_pairs")]
    extra = [
        "data.n_pairs=200",
        "data.clean_finetune_pairs=40",
        "defense.cleanclip_start_epoch=1",
        "audit_defense=",
    ]
    cfg = load_config(recipe.Config, spec["config"], [*mini, *extra])
    assert cfg.data.testbed == "fashion_web" and cfg.defenses == (*DEFAULT_DEFENSES, "cleanclip")
    cfg = dataclasses.replace(cfg, defenses=(*cfg.defenses, "oracle"))  # and the floor claim's reference
    run = Run.create(tmp_path / "r", cfg, "otcclip-tiny", quiet=True)
    summary = recipe.run(cfg, run)
    for d in cfg.defenses:
        for m in ("zeroshot_acc", "linear_probe_acc", "asr_targeted", "asr_backdoor", "nn_concept_match"):
            assert 0.0 <= summary[f"{d}.{m}"] <= 1.0, (d, m)
    data = json.loads(
        (run.dir / "analysis" / "data.json").read_text()
    )  # 10 % of 200 captions are alt-text noise
    assert data["testbed"] == "fashion_web"
    assert data["n_caption_noise_generic"] + data["n_caption_noise_wrong"] == 20
    from reprlab.results.claims import evaluate_claims, parse_claims

    claims = parse_claims(spec["claims"], "otcclip-tiny")
    verdicts = {r.claim.name: r.holds for r in evaluate_claims(claims, summary)}
    single_run = {n for n in verdicts if n.endswith("_ci")}  # sweeps only: n/a on one run
    assert all(verdicts[n] is None for n in single_run)
    assert all(isinstance(verdicts[n], bool) for n in set(verdicts) - single_run)


def test_the_report_says_which_otcclip_the_row_is(micro_runs, tmp_path):
    """The claims quote the paper's abstract; the report says whether the 'otcclip' row is our re-design (the
    consensus flag without the swap) or our reconstruction of the paper's swap, from the run's config."""
    import shutil

    import yaml

    run_dir = tmp_path / "run"
    shutil.copytree(micro_runs["otcclip-mosaic-tiny"], run_dir)
    head, body = (run_dir / "config.yaml").read_text().split("\n", 1)
    cfg = yaml.safe_load(body)
    for flag, rematch, words in (("consensus", False, "our re-design [ours]: a neighbour-consensus"),
                                 ("consensus", True, "our re-design's flag [ours] with our reconstruction"),
                                 ("none", True, "our reconstruction")):  # fmt: skip
        cfg["defense"].update(flag=flag, rematch=rematch)
        (run_dir / "config.yaml").write_text(head + "\n" + yaml.safe_dump(cfg))
        assert f"The 'otcclip' row is {words}" in recipe.report_sections(run_dir)[0].text
