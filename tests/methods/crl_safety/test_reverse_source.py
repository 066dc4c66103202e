"""The reverse cross-source check: train on ollama-forge, evaluate on HarmBench and our hand-written harmless prompts."""

import dataclasses

import pytest

from reprlab.errors import ConfigError
from reprlab.methods.crl_safety import data as D
from reprlab.recipes import all_recipes

REVERSE = dict(harmful_source="ollama_forge", eval_source="harmbench")


def _keys(prompts):
    return {D.prompt_key(p) for p in prompts}


def test_reverse_trains_on_ollama_forge_without_harmbench_and_evaluates_on_harmbench_and_ours():
    # every training prompt of the pool (n_harmful_train = all 1,234 minus none held out) so a HarmBench behaviour
    # left in ollama-forge's list would show up
    n_pool = len(D.ollama_forge_harmful_without_harmbench())
    sp = D.make_splits(0, n_pool, 48, 40, 96, 4, "ollama_forge", **REVERSE)
    hb, ours = _keys(D.harmbench_prompts()), _keys(D.harmless_prompts("ours_matched"))
    alpaca = _keys(D.harmless_prompts("ollama_forge"))
    assert (len(sp.harmful_eval), len(sp.harmless_eval)) == (48, 96) and sp.eval_source == D.HARMBENCH_EVAL
    assert _keys(sp.harmful_eval) <= hb and _keys(sp.harmless_eval) <= ours
    assert len(sp.harmful_train) == n_pool == 1434 - 200  # ollama-forge holds all 200 HarmBench behaviours
    assert not _keys(sp.harmful_train) & hb and _keys(sp.harmful_train) <= _keys(D.ollama_forge_harmful())
    assert _keys(sp.harmless_train) <= alpaca
    # our harmless prompts that Alpaca also holds are never evaluated (6 of 170)
    assert not _keys(sp.harmless_eval) & alpaca and len(ours & alpaca) == 6
    again = D.make_splits(0, 40, 48, 40, 96, 4, "ollama_forge", **REVERSE)
    other = D.make_splits(1, 40, 48, 40, 96, 4, "ollama_forge", **REVERSE)
    assert again.harmful_eval == sp.harmful_eval and again.harmless_eval == sp.harmless_eval
    assert other.harmful_eval != sp.harmful_eval and other.harmful_train != again.harmful_train


def test_default_sources_are_unchanged_by_the_option():
    """harmful_source's default is the path every recorded crl-tiny figure ran: the same splits with it named."""
    a = D.make_splits(3, 40, 12, 40, 20, 24)
    b = D.make_splits(3, 40, 12, 40, 20, 24, harmful_source="harmbench_dna")
    assert dataclasses.asdict(a) == dataclasses.asdict(b)
    assert _keys(a.harmful_eval) <= _keys(D.harmbench_prompts())


def test_a_cross_source_check_refuses_to_evaluate_on_a_source_it_trains_on():
    with pytest.raises(ConfigError, match=r"must be one of \('harmbench_dna', 'ollama_forge'\)"):
        D.make_splits(0, 40, 12, 40, 20, 4, harmful_source="advbench")
    with pytest.raises(ConfigError, match="set data.harmful_source=ollama_forge"):
        D.make_splits(0, 40, 12, 40, 20, 4, eval_source="harmbench")  # trains on HarmBench
    with pytest.raises(ConfigError, match="set data.harmful_source=ollama_forge"):
        D.make_splits(0, 40, 12, 40, 20, 4, "ours", **REVERSE)  # harmless side would be our own prompts
    with pytest.raises(ConfigError, match="which the training also draws from"):
        D.make_splits(0, 40, 12, 40, 20, 4, "ollama_forge", eval_source="ollama_forge")
    with pytest.raises(ConfigError, match="both name the harmful training prompts"):
        D.make_splits(0, 4, 2, 3, 2, 2, user_jsonl="x.jsonl", harmful_source="ollama_forge")


def test_crl_cross_reverse_tiny_is_crl_cross_tiny_with_its_sources_swapped():
    cross, rev = (all_recipes()[n].build_config() for n in ("crl-cross-tiny", "crl-cross-reverse-tiny"))
    assert (rev.data.harmful_source, rev.data.harmless_source, rev.data.eval_source) == (
        "ollama_forge", "ollama_forge", "harmbench")  # fmt: skip
    swapped = dataclasses.replace(rev.data, harmful_source="harmbench_dna", harmless_source="ours",
                                  eval_source="ollama_forge")  # fmt: skip
    assert swapped == cross.data
    assert (rev.defense, rev.sft, rev.attack) == (cross.defense, cross.sft, cross.attack)
    assert all_recipes()["crl-cross-reverse-tiny"].claims() == all_recipes()["crl-tiny"].claims()


@pytest.mark.parametrize(
    ("data", "says", "never"),
    [
        (
            {},
            ["HarmBench's other behaviours + Do-Not-Answer", "held-out split of the training source"],
            "eval_source=",
        ),
        (
            {"eval_source": "ollama_forge"},
            [D.OLLAMA_FORGE_EVAL, "data.eval_source=ollama_forge: 0 harmful attacked"],
            "held-out split",
        ),
        (
            {"harmful_source": "ollama_forge", "harmless_source": "ollama_forge", "eval_source": "harmbench"},
            ["ollama-forge's harmful list less its HarmBench behaviours", "Alpaca-style", D.HARMBENCH_EVAL],
            "held-out split",
        ),
    ],
)
def test_the_report_names_the_training_and_evaluation_sources(tmp_path, data, says, never):
    """A cross-source run's report must not call its evaluation prompts the training source's held-out split."""
    import yaml

    from reprlab.methods.crl_safety import recipe as R

    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"model": "m", "data": data}))
    setup = next(s for s in R.report_sections(tmp_path) if s.title == "Setup").text
    assert all(x in setup for x in says), setup
    assert never not in setup
