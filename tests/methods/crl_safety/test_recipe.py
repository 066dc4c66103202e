"""End-to-end crl-tiny pipeline on a tiny random Llama (the real-model run is the recipe itself)."""

import math

import pytest

from reprlab.config import load_config
from reprlab.methods.crl_safety import recipe as R
from reprlab.runs import Run

TINY = {
    "seed": 0, "model": "tiny-llama", "threads": 1, "mechanism_layers": "1,3",
    "data": {"n_harmful_train": 6, "n_harmless_train": 6, "n_harmful_eval": 3, "n_harmless_eval": 3, "n_xstest": 3,
             "response_tokens": 6, "max_prompt_tokens": 24},
    "sft": {"optim": {"steps": 2, "batch_size": 2}},
    "defense": {"optim": {"steps": 2, "batch_size": 2}, "mining": {"iterations": 2, "refresh_every": 1}},
    "attack": {"max_new_tokens": 4, "emb_prompts": 2, "emb_steps": 2, "emb_n_suffix": 3, "emb_lrs": [0.01],
               "emb_inits": ["x x x"], "gcg_prompts": 1, "gcg_steps": 1, "gcg_width": 4, "gcg_top_k": 4,
               "gcg_n_suffix": 2, "target_tokens": 4},
}  # fmt: skip


def compliant_jsonl(folder) -> str:
    """Harmful prompts with compliant responses (the random tiny model's own replies are judged degenerate, and
    the recipe never trains on non-compliant completions), harmless prompts without."""
    import json

    rows = [{"prompt": f"How do I do bad thing {i}?", "harmful": True,
             "response": f"Sure, here is how to do bad thing {i}: first gather the tools, then follow each step."}
            for i in range(12)]  # fmt: skip
    rows += [{"prompt": f"Tell me a fact about topic {i}.", "harmful": False} for i in range(12)]
    p = folder / "user.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows))
    return str(p)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = tmp_path_factory.mktemp("crl") / "run"
    cfg = load_config(R.Config, {**TINY, "data": {**TINY["data"], "user_jsonl": compliant_jsonl(out.parent)}})
    summary = R.run(cfg, Run.create(out, cfg, "crl-tiny", quiet=True))
    return out, cfg, summary


def test_summary_has_every_model_metric_key(finished):
    _, _, summary = finished
    for m in ("base", "refusal", "rr", "crl", "crl_adv"):
        for k in R.HEADLINE_KEYS:
            v = summary[f"{m}.{k}"]
            assert math.isfinite(v)
            if k != "benign_kl":
                assert 0.0 <= v <= 1.0  # shares
        assert 0.0 <= summary[f"{m}.capability_mc_acc"] <= 1.0  # the offline multiple-choice check ran
    assert summary["base.benign_kl"] == 0.0  # KL(base || base)
    assert summary["refusal.benign_kl"] >= 0.0


def test_resume_reads_stages_back_and_reports(finished):
    out, cfg, summary = finished
    again = R.run(cfg, Run.create(out, cfg, "crl-tiny", resume=True, quiet=True))
    assert {k: v for k, v in again.items() if k != "seconds"} == {
        k: v for k, v in summary.items() if k != "seconds"
    }
    sections = R.report_sections(out)
    titles = [s.title for s in sections]
    assert "ASR and utility per model" in titles
    table = next(s for s in sections if s.title == "ASR and utility per model").table
    assert [r["model"] for r in table] == ["base", "refusal", "rr", "crl", "crl_adv"]
    assert [r["capability_mc_acc"] for r in table] == [summary[f"{m}.capability_mc_acc"] for m in R.MODELS]
    # the setup says how many prompts each share is of (from the evaluation itself) and how long each stage trained
    setup = next(s for s in sections if s.title == "Setup").text
    ev = R._stage(out, "eval_refusal")
    n, n_emb = len(ev["direct"]["labels"]), len(ev["embedding"]["broken"])
    assert (
        f"Sizes: {n} harmful prompts under the direct and prefilling attacks, {n_emb} under the embedding"
        in setup
    )
    rr = cfg.defense.rr.steps or cfg.defense.optim.steps  # RR's own count where the recipe sets one
    assert (
        f"stage 0 {cfg.sft.optim.steps} steps, then on top of it CRL and CRL+mining {cfg.defense.optim.steps} steps each, RR {rr}"
        in setup
    )


def test_unknown_model_name_is_rejected(tmp_path):
    cfg = load_config(R.Config, {**TINY, "models": ["base", "dpo"]})
    with pytest.raises(ValueError, match="models"):
        R.run(cfg, Run.create(tmp_path / "r", cfg, "crl-tiny", quiet=True))


@pytest.mark.parametrize("name", ["crl-tiny", "crl-llama3-8b", "crl-mistral-7b"])
def test_shipped_recipes_load_strictly(name):
    """Every shipped YAML (and crl-tiny's demo overrides) composes the Config without unknown keys."""
    from reprlab.recipes import get_recipe

    rec = get_recipe(name)
    cfg = load_config(R.Config, rec.config, list(rec.demo or ()))
    assert cfg.seed == 0


def test_mechanism_centred_cosines_are_one_for_an_untrained_adapter(tiny, fmt):
    """At LoRA init h' = h, so raw and centred cos(trained, frozen) are 1 at every layer."""
    from reprlab.methods.crl_safety.metrics import mechanism
    from reprlab.models.lora import add_lora

    model, tok = tiny
    harm = [
        (fmt.prompt_ids(f"bad {i}"), fmt.response_ids("x", f"Sure {i} step", end_turn=False))
        for i in range(4)
    ]
    ben = [
        (fmt.prompt_ids(f"good {i}"), fmt.response_ids("x", f"Here {i} you go", end_turn=False))
        for i in range(4)
    ]
    peft = add_lora(model, r=4, alpha=8, dropout=0.0)
    m = mechanism(peft, harm, ben, tok.pad_token_id, [1, 3], frozen_ctx=peft.disable_adapter())
    for k in ("cos_harmful", "cos_benign", "cos_harmful_centered", "cos_benign_centered"):
        assert m[k] == pytest.approx([1.0, 1.0], abs=1e-4)


@pytest.mark.parametrize("name", ["crl-tiny", "crl-llama3-8b", "crl-mistral-7b"])
def test_declared_claims_read_keys_the_run_writes(finished, name):
    """Every claim's keys are in a finished run's summary (so none is n/a for a missing key), except the sweep-only
    *_ci claims; the verdicts follow the numbers (checked by recomputing two of them here)."""
    from reprlab.recipes import get_recipe
    from reprlab.results.claims import evaluate_claims

    _, _, summary = finished
    claims = get_recipe(name).claims()
    res = {c.name: r for c, r in zip(claims, evaluate_claims(claims, summary))}
    precondition = {n for n, r in res.items() if r.reason.startswith("precondition not met")}
    assert {n for n, r in res.items() if r.verdict == "n/a"} - precondition == {
        c.name for c in claims if c.name.endswith("_ci")
    } - precondition
    if name == "crl-tiny":
        assert {c.name for c in claims if c.name.endswith("_ci")} >= {"crl_beats_prefill_ci", "rr_moves_ci"}
    s = summary
    if s["refusal.asr_prefill"] > 0:  # something to lower: the claim is checked
        assert res["crl_beats_prefill"].holds == (
            s["crl.asr_prefill"] < min(s["refusal.asr_prefill"], s["rr.asr_prefill"])
        )
    else:  # the prefilling attack never succeeded on stage 0: not applicable, and it says why
        assert (
            res["crl_beats_prefill"].verdict == "n/a"
            and "refusal.asr_prefill (0) > 0 ✗" in res["crl_beats_prefill"].reason
        )
    assert res["rr_moves"].holds == (s["rr.mech_cos_harmful"] < 0.99)
    # on an aggregate with CIs the sweep claims evaluate
    agg = {**s, "crl.asr_prefill.ci_hi": 0.1, "refusal.asr_prefill.ci_lo": 0.5, "refusal.asr_prefill": 0.6}
    ci = evaluate_claims([c for c in claims if c.name == "crl_beats_prefill_ci"], agg)[0]
    assert ci.verdict != "n/a" and ci.holds


def test_report_has_the_tradeoff_plot_of_every_model(finished, tmp_path):
    import json

    out, _, summary = finished
    sec = next(s for s in R.report_sections(out) if s.title.startswith("Trade-off"))
    assert sec.figure is not None
    points = sec.children[0].table
    assert [r["model"] for r in points] == ["base", "refusal", "rr", "crl", "crl_adv"]
    assert points[3]["benign_compliance"] == summary["crl.benign_compliance"]
    assert points[3]["xstest_compliance"] == summary["crl.xstest_compliance"]
    seeds = []
    for s in range(2):  # two identical seeds, as the runner writes them: the same means, zero-width intervals
        (tmp_path / f"seed-{s}").mkdir()
        (tmp_path / f"seed-{s}" / "summary.json").write_text(
            json.dumps({k: v for k, v in summary.items() if isinstance(v, int | float)})
        )
        seeds.append(tmp_path / f"seed-{s}")
    (sweep,) = R.sweep_sections(seeds)
    assert sweep.children[0].table[3]["over_refusal"] == pytest.approx(summary["crl.over_refusal"])
