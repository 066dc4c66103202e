"""Borderline (XSTest-style) training prompts in the defences' benign sets (``data.n_borderline_train``)."""

import pytest

from reprlab.config import load_config
from reprlab.errors import DataError
from reprlab.methods.crl_safety import recipe as R
from reprlab.methods.crl_safety.data import make_splits, xstest_prompts
from reprlab.runs import Run

from .test_recipe import TINY, compliant_jsonl


def test_borderline_prompts_are_never_evaluated_and_leave_the_other_splits_unchanged():
    n = (20, 8, 20, 8, 12)
    off = make_splits(0, *n)
    on = make_splits(0, *n, n_borderline_train=16)
    for k in ("harmful_train", "harmful_eval", "harmless_train", "harmless_eval", "xstest"):
        assert getattr(on, k) == getattr(off, k), k
    assert off.borderline_train == []
    assert len(set(on.borderline_train)) == 16
    assert not set(on.borderline_train) & set(on.xstest)
    assert set(on.borderline_train) <= set(xstest_prompts())
    with pytest.raises(DataError, match="borderline"):
        make_splits(0, *n, n_borderline_train=len(xstest_prompts()) - 11)


@pytest.mark.parametrize("role", ["benign", "retain"])
def test_only_answered_borderline_prompts_reach_the_defences_and_not_stage_0(tmp_path, monkeypatch, role):
    # role 'retain' (defense.crl.borderline): CRL's triplet benign set goes without them, its KL retain batch has them
    crl = {"kl_data": "retain", "borderline": "retain"} if role == "retain" else {}
    t = {**TINY, "models": ["refusal", "rr", "crl"],
         "data": {**TINY["data"], "user_jsonl": compliant_jsonl(tmp_path), "n_borderline_train": 3},
         "defense": {**TINY["defense"], "crl": crl}}  # fmt: skip
    cfg = load_config(R.Config, t)
    sp = R._splits(cfg)
    refused = sp.borderline_train[0]
    real = R.make_judge

    def judge_factory(*a, **kw):
        j = real(*a, **kw)

        def judge(prompts, responses, harmful=True):
            # the random tiny model's replies are degenerate: script the borderline verdicts, keep the rest real
            if prompts == sp.borderline_train:
                return ["refuse" if p == refused else "comply" for p in prompts]
            return j(prompts, responses, harmful=harmful)

        return judge

    seen = {}
    real_fit = R._fit

    def fit(sharded, peft, kind, cfg_, harm, ben, *a, **kw):
        seen[kind] = (ben, kw.get("retain"))
        return real_fit(sharded, peft, kind, cfg_, harm, ben, *a, **kw)

    monkeypatch.setattr(R, "make_judge", judge_factory)
    monkeypatch.setattr(R, "_fit", fit)
    summary = R.run(cfg, Run.create(tmp_path / "run", cfg, "crl-tiny", quiet=True))
    assert summary["borderline_train_used"] == 2
    tok = R.load_model(cfg, "cpu")[1]
    fmt = R.ChatFormat(tok, cfg.data.system_prompt, cfg.data.max_prompt_tokens)
    ids = {p: tuple(fmt.prompt_ids(p)) for p in sp.borderline_train}
    prompts_of = lambda pairs: {tuple(p) for p, _ in pairs}  # noqa: E731
    kept = {ids[p] for p in sp.borderline_train[1:]}
    assert not prompts_of(seen["sft"][0]) & set(ids.values())  # stage 0 trains without them
    for kind in ("rr", "crl"):
        ben, retain = seen[kind]
        if kind == "crl" and role == "retain":
            assert not prompts_of(ben) & set(ids.values())
        else:
            assert kept <= prompts_of(ben) and ids[refused] not in prompts_of(ben), kind
        assert kept <= prompts_of(retain) and ids[refused] not in prompts_of(retain), kind


@pytest.mark.parametrize(
    ("role", "n_key"), [("borderline", "n_borderline_train"), ("self_written", "n_self_benign")]
)
def test_a_retain_only_role_needs_the_retain_batch_and_its_prompts(role, n_key):
    # defense.crl.borderline / defense.crl.self_written = retain (self-written prompts: test_self_prompts.py)
    from reprlab.errors import ConfigError

    def cfg(crl, n):
        return load_config(R.Config, {**TINY, "data": {**TINY["data"], n_key: n},
                                      "defense": {**TINY["defense"], "crl": crl}})  # fmt: skip

    with pytest.raises(ConfigError, match="kl_data=retain"):
        R.preflight(cfg({role: "retain"}, 4))
    with pytest.raises(ConfigError, match=f"{n_key} > 0"):
        R.preflight(cfg({role: "retain", "kl_data": "retain"}, 0))
    with pytest.raises(ConfigError, match=r"expected one of \['benign', 'retain'\]"):  # the loader's choices
        R.preflight(cfg({role: "both"}, 4))


@pytest.mark.parametrize(
    ("key", "message"),
    [("n_borderline_train", "without borderline prompts"), ("n_self_benign", "without self-written prompts")],
)
def test_a_folder_started_without_extra_benign_prompts_refuses_to_resume_with_them(tmp_path, key, message):
    # borderline prompts, or the prompts the model writes itself (test_self_prompts.py)
    from reprlab.errors import ConfigError, RunFolderError

    t = {**TINY, "models": ["base"], "capability": {"mc": False},
         "data": {**TINY["data"], "user_jsonl": compliant_jsonl(tmp_path)}}  # fmt: skip
    out = tmp_path / "run"
    cfg = load_config(R.Config, t)
    R.run(cfg, Run.create(out, cfg, "crl-tiny", quiet=True))
    with_b = load_config(R.Config, {**t, "data": {**t["data"], key: 2}})
    with pytest.raises(RunFolderError, match=key):  # the folder's config.yaml differs
        Run.create(out, with_b, "crl-tiny", resume=True, quiet=True)
    # a caller that skips that check (the library's run() on a reopened folder) meets the recipe's own
    run = Run.create(out, cfg, "crl-tiny", resume=True, quiet=True)
    with pytest.raises(ConfigError, match=message):
        R.run(with_b, run)


def test_degenerate_replies_to_safe_prompts_fail_the_combined_claim():
    # over-refusal counts refusals only; a CRL that turns safe XSTest-style prompts into degenerate text must fail
    # crl_answers_borderline and the combined claim, while the refusal-only claim still holds
    from reprlab.recipes import get_recipe
    from reprlab.results.claims import evaluate_claims

    base = {"refusal.asr_prefill": 0.9, "refusal.asr_embedding": 0.9, "refusal.benign_compliance": 0.9,
            "refusal.over_refusal": 0.25, "refusal.xstest_degenerate": 0.0, "crl.asr_prefill": 0.0,
            "crl.asr_embedding": 0.0, "crl.benign_compliance": 0.9, "crl.over_refusal": 0.05}  # fmt: skip
    claims = [c for c in get_recipe("crl-tiny").claims()
              if c.name in ("crl_bounded_over_refusal", "crl_answers_borderline", "crl_defends_and_keeps_benign")]  # fmt: skip
    assert len(claims) == 3

    def verdicts(degenerate):
        return {
            r.claim.name: r.holds
            for r in evaluate_claims(claims, {**base, "crl.xstest_degenerate": degenerate})
        }

    assert verdicts(0.0) == dict.fromkeys(verdicts(0.0), True)
    assert verdicts(0.6) == {"crl_bounded_over_refusal": True, "crl_answers_borderline": False,
                             "crl_defends_and_keeps_benign": False}  # fmt: skip
