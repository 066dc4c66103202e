"""Every JSON reprlab writes is standard JSON: non-finite floats become null, and a stage keeps them."""

import math

import numpy as np
import pytest

from reprlab.jsonfile import (
    dumps_json,
    loads_strict,
    nonfinite_pointers,
    restore_nonfinite,
    with_null_reasons,
)


def test_nan_and_infinity_become_null_and_a_strict_parser_reads_it():
    obj = {"a": float("nan"), "b": [1.0, float("inf"), np.float64("-inf")], "c": np.array([0.5, np.nan]),
           "d/e": {"f": np.float32(2.0)}}  # fmt: skip
    text = dumps_json(obj)
    assert "NaN" not in text and "Infinity" not in text
    assert loads_strict(text) == {"a": None, "b": [1.0, None, None], "c": [0.5, None], "d/e": {"f": 2.0}}
    with pytest.raises(ValueError, match="NaN is not JSON"):
        loads_strict('{"x": NaN}')


def test_pointers_restore_the_exact_non_finite_values():
    obj = {"r": [1.0, float("nan")], "s": {"t~u/v": float("-inf")}, "w": float("inf")}
    ptrs = nonfinite_pointers(obj)
    assert ptrs == {"/r/1": "nan", "/s/t~0u~1v": "-inf", "/w": "inf"}  # RFC 6901 escaping
    back = restore_nonfinite(loads_strict(dumps_json(obj)), ptrs)
    assert math.isnan(back["r"][1]) and back["s"]["t~u/v"] == -math.inf and back["w"] == math.inf


def test_flat_summaries_get_a_sibling_reason():
    out = with_null_reasons({"x": float("nan"), "y": 1.0, "z": float("inf")}, {"x": "one piece per word"})
    assert out == {"x": None, "x.null_reason": "one piece per word", "y": 1.0, "z": None,
                   "z.null_reason": "not a finite number (+Infinity)"}  # fmt: skip


def test_stage_results_with_nan_resume_identically(tmp_path):
    from dataclasses import dataclass

    from reprlab.runs import Run

    @dataclass(frozen=True)
    class C:
        seed: int = 0

    run = Run.create(tmp_path / "r", C(), "smoke-digits", quiet=True)
    fresh = run.stage("s", lambda: {"rho": float("nan"), "v": [1.0, float("inf")]})
    run.close(True)
    text = (tmp_path / "r" / "stages" / "s.json").read_text()
    loads_strict(text)  # standard JSON on disk
    again = Run.create(tmp_path / "r", C(), "smoke-digits", resume=True, quiet=True)
    resumed = again.stage("s", lambda: pytest.fail("a finished stage is read back, not re-run"))
    again.close(True)
    assert (
        math.isnan(fresh["rho"])
        and math.isnan(resumed["rho"])
        and resumed["v"] == fresh["v"] == [1.0, math.inf]
    )
