"""Claims are parsed against a whitelist (never eval'ed) and evaluated to known answers."""

import pytest

from reprlab.errors import ConfigError
from reprlab.results.claims import claim_summary_keys, evaluate_claims, parse_claims


def _one(check, name="c"):
    return parse_claims([{"name": name, "text": "t", "check": check}], "recipe.yaml")[0]


@pytest.mark.parametrize(
    ("check", "summary", "holds"),
    [
        ("{a} >= 0.5", {"a": 0.5}, True),
        ("{a} >= 0.5", {"a": 0.49}, False),
        ("{o.zs} >= max({r.zs}, {s.zs}) - 0.01", {"o.zs": 0.50, "r.zs": 0.40, "s.zs": 0.505}, True),
        ("{o.zs} >= max({r.zs}, {s.zs}) - 0.01", {"o.zs": 0.49, "r.zs": 0.40, "s.zs": 0.505}, False),
        ("{a} < {b} and not {c} > 1", {"a": 1, "b": 2, "c": 0}, True),
        ("0 < {a} < 1", {"a": 1.0}, False),  # chained comparison, both sides
        ("abs({a} - {b}) <= 0.1 or {c} == 3", {"a": 1, "b": 5, "c": 3}, True),
        ("{a} / {b} > 2", {"a": 5, "b": 2}, True),
    ],
)
def test_known_answers(check, summary, holds):
    assert _one(check).evaluate(summary).holds is holds


def test_missing_or_non_numeric_keys_are_not_measured_rather_than_false():
    c = _one("{a} > {b}")
    for summary in ({"a": 1}, {"a": 1, "b": "x"}, {"a": 1, "b": float("nan")}, {"a": True, "b": 0}):
        r = c.evaluate(summary)
        assert r.holds is None and r.verdict == "n/a" and "not measured" in r.evidence
    assert claim_summary_keys([c.evaluate({"a": 1})]) == {}
    assert claim_summary_keys([c.evaluate({"a": 2, "b": 1})]) == {"claims.c": 1}


@pytest.mark.parametrize(
    "check, summary, holds",
    [
        ("{a} >= 0.9 and {b} < {c}", {"a": 0.0, "b": 1.0}, False),  # a fails: c cannot rescue it
        ("{a} >= 0.9 and {b} < {c}", {"a": 0.95, "b": 1.0}, None),  # c decides
        ("{a} >= 0.9 or {b} < 1", {"a": 0.95}, True),
        ("{a} >= 0.9 or {b} < 1", {"a": 0.5}, None),
        ("not ({a} > 1 and {b} > 1)", {"a": 0.0}, True),
        ("{a} > 0 and max({a}, {b}) > 1", {"a": -1.0}, False),
        ("{a} > 0 and {b.ci_lo} > 0", {"a": -1.0}, None),  # a sweep-only claim stays n/a on one run
        ("{a} > 0 and {b.ci_lo} > 0 and {c} > 0", {"a": -1.0}, None),  # ... whatever else it misses
        ("{a} / {b} > 1 and {c} > 0", {"a": 1.0, "b": 0.0}, None),  # an undefined part decides nothing
    ],
)
def test_keys_that_were_measured_decide_when_the_missing_ones_cannot_change_the_verdict(
    check, summary, holds
):
    """Three-valued logic: memorisation that never reached 0.9 fails the claim, though the step where it reached
    0.5 (another of its keys) does not exist; n/a only where a missing key could still change the verdict."""
    result = _one(check).evaluate(summary)
    assert result.holds is holds, result.evidence
    if holds is not None:
        assert "decided without the keys it could not read" in result.evidence


def test_evidence_shows_the_numbers():
    r = _one("{none.asr} >= 0.5").evaluate({"none.asr": 0.75})
    assert r.evidence == "none.asr=0.75 >= 0.5" and r.verdict == "holds"


@pytest.mark.parametrize(
    "check",
    [
        "__import__('os').system('true')",
        "{a}.__class__",
        "{a} if {b} else 0",
        "[{a}][0]",
        "len({a})",
        "{a} ** 2",
    ],
)
def test_anything_but_the_small_grammar_is_refused(check):
    with pytest.raises(ConfigError, match="recipe.yaml"):
        _one(check)


def test_recipe_claims_are_validated_when_the_recipe_loads(tmp_path):
    from reprlab.recipes import load_recipe_file

    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "description: x\nentry: reprlab.methods.smoke.recipe\nconfig: {}\n"
        "claims:\n  - {name: a, check: '{x} >'}\n"
    )
    with pytest.raises(ConfigError, match=r"bad.yaml: claim 'a'"):
        load_recipe_file(bad)
    dup = tmp_path / "dup.yaml"
    dup.write_text(
        "description: x\nentry: reprlab.methods.smoke.recipe\nconfig: {}\n"
        "claims:\n  - {name: a, check: '{x} > 1'}\n  - {name: a, check: '{y} > 1'}\n"
    )
    with pytest.raises(ConfigError, match="used twice"):
        load_recipe_file(dup)


def test_every_shipped_recipe_declares_claims_that_parse():
    from reprlab.recipes import all_recipes

    for name, recipe in all_recipes().items():
        assert isinstance(recipe.claims(), tuple), name
        assert recipe.claims(), f"{name} declares no claims"  # every recipe says what it exists to test


def test_evaluate_claims_keeps_order():
    cs = parse_claims([{"name": "x", "check": "{a} > 0"}, {"name": "y", "check": "{a} < 0"}], "r")
    assert [r.holds for r in evaluate_claims(cs, {"a": 1})] == [True, False]


def test_a_failed_precondition_is_not_applicable_not_false():
    c = parse_claims([{"name": "shared", "text": "t", "requires": "{mem} >= 0.5", "check": "{iou} > {null} + 0.05"}],
                     "r")[0]  # fmt: skip
    r = c.evaluate({"mem": 0.0, "iou": 0.1, "null": 0.2})
    assert r.holds is None and r.verdict == "n/a" and r.reason.startswith("precondition not met")
    assert "mem (0) ≥ 0.5 ✗" in r.reason
    assert c.evaluate({"mem": 0.9, "iou": 0.1, "null": 0.2}).verdict == "does not hold"
    assert c.evaluate({"mem": 0.9, "iou": 0.4, "null": 0.2}).verdict == "holds"
    assert claim_summary_keys([r]) == {}  # n/a: no claims.<name> key, so a sweep's share skips this seed


def test_evidence_reads_as_one_line_per_comparison():
    c = _one("({a.v} >= 1 and {a.rho} >= 0.3) or {b} < max({c}, {d}) - 0.01")
    r = c.evaluate({"a.v": 0, "a.rho": 0.504, "b": 0.2, "c": 0.1, "d": 0.3})
    assert r.lines == (
        "any of: ✓",
        "  all of: ✗",
        "    a.v (0) ≥ 1 ✗",
        "    a.rho (0.504) ≥ 0.3 ✓",
        "  b (0.2) < max(c (0.1), d (0.3)) − 0.01 = 0.29 ✓",
    )


def test_n_a_says_why():
    assert _one("{x.ci_hi} < {y.ci_lo}").evaluate({}).reason.startswith("sweep only")
    r = _one("{x} > 0").evaluate({"x": None, "x.null_reason": "one piece per word"})
    assert r.reason == "undefined on this run: x (one piece per word)"
    assert _one("{x} > 0").evaluate({}).reason == "not measured: x"
    # a key a run never wrote (its model was switched off, another depth): said, beside the key
    assert _one("{minilm_L6.x} > 0").evaluate({"other_L2.x": 1.0}).reason == (
        "not measured: minilm_L6.x (not in this run's summary: the model, layer or analysis it names did not run "
        "here)"
    )
