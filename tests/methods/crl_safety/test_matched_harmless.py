"""The form-matched harmless set: our harmless prompts plus task requests in the harmful prompts' forms."""

from collections import Counter

import pytest

from reprlab.errors import ConfigError
from reprlab.methods.crl_safety import data as D


def _lead(prompts):
    return Counter(p.split()[0].strip(",.").lower() for p in prompts)


def test_matched_set_is_ours_plus_100_distinct_task_requests():
    ours, matched = D.harmless_prompts("ours"), D.harmless_prompts("ours_matched")
    assert matched[: len(ours)] == ours
    assert len(matched) == len(ours) + 100
    assert len({D.prompt_key(p) for p in matched}) == len(matched)


def test_matched_set_covers_the_forms_harmbench_requests_take():
    # HarmBench behaviours open with a handful of imperatives ("Write ...", "Give ...", ...). A harmless set that
    # never uses a form lets a defence refuse by form; the matched set holds at least 5 of each of the five
    # commonest, where our question-style set lacks some entirely.
    top = [w for w, _ in _lead(D.harmbench_prompts()).most_common(5)]
    ours, matched = _lead(D.harmless_prompts("ours")), _lead(D.harmless_prompts("ours_matched"))
    assert all(matched[w] >= 5 for w in top), {w: matched[w] for w in top}
    assert min(ours[w] for w in top) < 5


def test_matched_set_stays_out_of_the_cross_source_evaluation():
    s = D.make_splits(0, 40, 12, 40, 24, 12, "ours_matched", eval_source="ollama_forge")
    train_pool = {D.prompt_key(p) for p in D.harmless_prompts("ours_matched")}
    assert len(s.harmless_eval) == 24
    assert not {D.prompt_key(p) for p in s.harmless_eval} & train_pool
    assert set(s.harmless_train) <= set(D.harmless_prompts("ours_matched"))


def test_unknown_harmless_source_names_the_valid_ones():
    with pytest.raises(ConfigError, match="ours_matched"):
        D.harmless_prompts("alpaca")
