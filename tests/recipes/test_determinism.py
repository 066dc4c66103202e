"""Same seed, same machine, same threads: the same summary, bit for bit, for every recipe family.

(smoke-digits: tests/unit/runs/test_folder_safety.py; Norm-IC: tests/methods/norm_ic.) Each run here is a
micro variant of the tiny recipe so the pair fits the fast suite; they go through the whole pipeline
(data, training, every analysis, claims) like the real recipe. ``wall_time_s`` and ``seconds`` are clocks.
"""

import json

import pytest

from reprlab.runner import execute
from tests.micro_runs import OTC_MICRO, ROTE_MICRO

CLOCKS = ("wall_time_s", "seconds")


def _summary(run_dir):
    s = json.loads((run_dir / "summary.json").read_text())
    return {k: v for k, v in s.items() if not k.endswith(CLOCKS)}


@pytest.mark.parametrize(
    ("recipe", "overrides"), [("rote-fda-tiny", ROTE_MICRO), ("otcclip-mosaic-tiny", OTC_MICRO)]
)
def test_same_seed_same_summary(tmp_path, micro_runs, recipe, overrides):
    a = micro_runs[recipe]  # the session's run of this micro variant (tests/micro_runs.py)
    b = execute(recipe, overrides, tmp_path / "b", quiet=True)
    sa, sb = _summary(a), _summary(b)
    assert len(sa) > 10  # the whole pipeline ran, not just training
    assert sa == sb, {k: (sa.get(k), sb.get(k)) for k in sa.keys() | sb.keys() if sa.get(k) != sb.get(k)}


def test_crl_same_seed_same_summary(tmp_path):
    from reprlab.config import load_config
    from reprlab.methods.crl_safety import recipe as R
    from reprlab.runs import Run
    from tests.methods.crl_safety.test_recipe import TINY, compliant_jsonl

    cfg = load_config(R.Config, {**TINY, "data": {**TINY["data"], "user_jsonl": compliant_jsonl(tmp_path)}})
    out = []
    for name in ("a", "b"):
        run = Run.create(tmp_path / name, cfg, "crl-tiny", quiet=True)
        try:
            out.append({k: v for k, v in R.run(cfg, run).items() if not k.endswith(CLOCKS)})
        finally:
            run.close(success=True)
    assert len(out[0]) > 10 and out[0] == out[1]
