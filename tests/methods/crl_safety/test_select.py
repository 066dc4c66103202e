"""Choosing a defence's step on validation prompts (``defense.select``): the rule, the splits, the pipeline."""

import math

import pytest
import torch
from safetensors.torch import load_file

from reprlab.config import load_config
from reprlab.errors import ConfigError, DataError
from reprlab.jsonfile import read_stage
from reprlab.methods.crl_safety import recipe as R
from reprlab.methods.crl_safety.data import make_splits
from reprlab.methods.crl_safety.select import choose_step, validation_steps
from reprlab.runs import Run

from .test_recipe import TINY, compliant_jsonl


def _pts(*bc):
    return [{"step": 2 * (i + 1), "benign_compliance": v, "asr_prefill": 0.0} for i, v in enumerate(bc)]


# ---------------------------------------------------------------------- the rule


def test_rule_picks_the_latest_step_at_or_above_the_floor():
    # floor 0.6 - 0.05 = 0.55: steps 2 (0.7) and 6 (0.6) qualify, step 4 (0.5) and 8 (0.3) do not
    c = choose_step(_pts(0.7, 0.5, 0.6, 0.3), reference=0.6, tolerance=0.05)
    assert (c.step, c.qualified) == (6, True)
    assert c.floor == pytest.approx(0.55)


def test_rule_takes_the_earliest_step_when_none_qualifies():
    c = choose_step(_pts(0.2, 0.4, 0.1), reference=0.9, tolerance=0.05)
    assert (c.step, c.qualified) == (2, False)


def test_balanced_fallback_trades_benign_against_prefill_when_none_qualifies():
    """crl-cross-tiny seed 1's CRL points (validation benign, prefill ASR by step; stage 0 0.83): none reaches the
    floor 0.78; benign - prefill is -0.33, 0.58, 0.63, 0.42, so 'balanced' takes step 24, 'earliest' step 8."""
    pts = [{"step": s, "benign_compliance": b, "asr_prefill": a}
           for s, b, a in ((8, 8 / 12, 1.0), (16, 7 / 12, 0.0), (24, 9 / 12, 1 / 8), (32, 8 / 12, 2 / 8))]  # fmt: skip
    assert choose_step(pts, 10 / 12, 0.05).step == 8
    c = choose_step(pts, 10 / 12, 0.05, fallback="balanced")
    assert (c.step, c.qualified) == (24, False)
    # a step that qualifies wins whatever the fallback; equal scores go to the latest step
    assert choose_step(pts, 9 / 12, 0.05, fallback="balanced").step == 24
    tie = [{"step": 2, "benign_compliance": 0.5, "asr_prefill": 0.0}, {"step": 4, "benign_compliance": 0.7,
           "asr_prefill": 0.2}, {"step": 6, "benign_compliance": 0.1, "asr_prefill": 0.0}]  # fmt: skip
    assert choose_step(tie, 0.9, 0.05, fallback="balanced").step == 4
    with pytest.raises(ValueError, match="fallback"):
        choose_step(pts, 0.5, 0.05, fallback="best")


def test_rule_tolerance_boundary_counts_as_qualifying():
    # 9/20 = 0.45 is exactly stage 0's 0.5 minus 0.05 (up to rounding of 0.5 - 0.05): qualifies; 0.44 does not
    assert choose_step(_pts(0.9, 9 / 20), reference=0.5, tolerance=0.05).step == 4
    assert choose_step(_pts(0.9, 0.44), reference=0.5, tolerance=0.05).step == 2
    assert choose_step(_pts(0.9, 0.44), reference=0.5, tolerance=0.06).step == 4


def test_rule_last_and_bad_input():
    assert choose_step(_pts(0.9, 0.0), reference=1.0, tolerance=0.0, rule="last").step == 4
    assert choose_step(list(reversed(_pts(0.9, 0.8, 0.1))), reference=0.8, tolerance=0.0).step == 4
    with pytest.raises(ValueError, match="no validation points"):
        choose_step([], 0.5, 0.05)
    with pytest.raises(ValueError, match="rule"):
        choose_step(_pts(0.5), 0.5, 0.05, rule="best")


def test_validation_steps_end_at_the_last_step():
    assert validation_steps(8, 3) == [3, 6, 8]
    assert validation_steps(4, 1) == [1, 2, 3, 4]
    assert validation_steps(4, 8) == [4]


# ---------------------------------------------------------------------- splits


@pytest.mark.parametrize("source", ["packaged", "user"])
def test_validation_prompts_are_disjoint_and_leave_the_other_splits_unchanged(tmp_path, source):
    kw = {"user_jsonl": compliant_jsonl(tmp_path)} if source == "user" else {}
    n = (4, 3, 4, 3, 3) if source == "user" else (20, 8, 20, 8, 5)
    off = make_splits(0, *n, **kw)
    on = make_splits(0, *n, n_harmful_val=3, n_harmless_val=2, **kw)
    for k in ("harmful_train", "harmful_eval", "harmless_train", "harmless_eval", "xstest"):
        assert getattr(on, k) == getattr(off, k), k
    assert off.harmful_val == [] and off.harmless_val == []
    assert len(on.harmful_val) == 3 and len(on.harmless_val) == 2
    used = set(on.harmful_train + on.harmful_eval + on.harmless_train + on.harmless_eval)
    assert not (set(on.harmful_val) | set(on.harmless_val)) & used
    assert len(set(on.harmful_val)) == 3 and len(set(on.harmless_val)) == 2
    with pytest.raises(DataError, match="harmless validation"):
        make_splits(0, *n, n_harmless_val=10_000, **kw)


@pytest.mark.parametrize(
    "line",
    [
        "defense.select.rule=benign_floor data.n_harmless_val=10 data.n_harmful_val=8",
        "data.eval_source=ollama_forge data.n_harmless_eval=24 defense.select.rule=benign_floor "
        "data.n_harmless_val=12 data.n_harmful_val=8",
    ],
)
def test_the_documented_crl_tiny_lines_have_enough_validation_prompts(line):
    from reprlab.recipes import get_recipe

    cfg = load_config(R.Config, get_recipe("crl-tiny").config, line.split())
    assert cfg.defense.select.rule == "benign_floor"
    R.check_select(cfg)
    sp = R._splits(cfg)
    assert (len(sp.harmful_val), len(sp.harmless_val)) == (cfg.data.n_harmful_val, cfg.data.n_harmless_val)


def test_select_config_is_checked_before_any_model_loads():
    with pytest.raises(ConfigError, match="n_harmless_val"):
        R.preflight(load_config(R.Config, {**TINY, "defense": {"select": {"rule": "benign_floor"}}}))
    t = {**TINY, "fsdp": True, "data": {**TINY["data"], "n_harmless_val": 2, "n_harmful_val": 2}}
    with pytest.raises(ConfigError, match="fsdp"):
        R.preflight(load_config(R.Config, t))
    with pytest.raises(ConfigError, match="expected one of"):
        load_config(R.Config, {**TINY, "defense": {"select": {"rule": "best"}}})


# ---------------------------------------------------------------------- pipeline


def _cfg(folder, models, **select):
    t = {**TINY, "models": models,
         "data": {**TINY["data"], "user_jsonl": compliant_jsonl(folder), "n_harmless_val": 3, "n_harmful_val": 2},
         "defense": {**TINY["defense"], "optim": {"steps": 4, "batch_size": 2, "checkpoint_every": 2},
                     "select": {"rule": "benign_floor", "every": 1, **select}}}  # fmt: skip
    return load_config(R.Config, t)


# scripted validation benign compliance (the random tiny model answers nothing): stage 0 0.5, then each defence's
# steps 1..4; floor 0.45, so step 2 is the latest that qualifies and the last step (4) is not chosen
SCRIPT = [0.6, 0.5, 0.4, 0.2]


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    out = tmp_path_factory.mktemp("sel") / "run"
    cfg = _cfg(out.parent, ["refusal", "rr", "crl", "crl_adv"])
    real, calls = R.validate, []

    def fake(*a, **kw):
        res = real(*a, **kw)  # the real generations and judge run; only the benign share is replaced
        res["benign_compliance"] = 0.5 if not calls else SCRIPT[(len(calls) - 1) % len(SCRIPT)]
        calls.append(res["benign_compliance"])
        return res

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(R, "validate", fake)
        summary = R.run(cfg, Run.create(out, cfg, "crl-tiny", quiet=True))
    return out, summary, calls


def _assert_exported_is_snapshot(run_dir, kind, step, same=True):
    """The defence's rows of A / columns of sB in the exported stacked adapter (stage 0's part first; LoRA scale
    alpha / r = 1 in TINY) against the snapshot of ``step``."""
    exp = load_file(str(run_dir / "adapters" / kind / "adapter_model.safetensors"))
    snap = load_file(str(run_dir / "selection" / kind / f"step_{step:08d}.safetensors"))
    equal = True
    for name, t in snap.items():
        path = name[len("base_model.model.") :].replace(f".lora_A.{kind}.weight", ".lora_A.weight")
        path = path.replace(f".lora_B.{kind}.weight", ".lora_B.weight")
        e = exp[f"base_model.model.{path}"]
        part = e[-t.shape[0] :] if ".lora_A." in path else e[:, -t.shape[1] :]
        equal &= torch.equal(part, t)  # same tensors copied, scale 1: bitwise
    assert equal == same


def test_rule_on_selects_the_step_and_exports_its_snapshot(scripted):
    out, summary, calls = scripted
    assert len(calls) == 1 + 3 * 4  # stage 0 once, then 4 validation points for each defence
    assert summary["refusal.val_benign_compliance"] == 0.5
    for kind in ("rr", "crl", "crl_adv"):
        assert summary[f"{kind}.selected_step"] == 2
        assert summary[f"{kind}.val_benign_compliance"] == 0.5
        assert 0.0 <= summary[f"{kind}.val_asr_prefill"] <= 1.0
        sel = read_stage(out / "stages" / f"select_{kind}.json")
        assert [p["step"] for p in sel["points"]] == [1, 2, 3, 4] and sel["qualified"]
        assert sel["snapshot"] == f"selection/{kind}/step_00000002.safetensors"
        _assert_exported_is_snapshot(out, kind, 2)
        _assert_exported_is_snapshot(out, kind, 4, same=False)  # the final step's adapter is a different one
    for k in R.HEADLINE_KEYS:
        assert math.isfinite(summary[f"crl.{k}"])


def test_reprlab_export_gives_the_selected_step_not_the_last(scripted, tmp_path):
    """`reprlab export --adapter` rebuilds a defence from the run folder: with defense.select it must be the
    chosen step, the one the run evaluated and wrote to adapters/<kind>/ (it gave the last checkpoint, step 4)."""
    from reprlab.methods.crl_safety.export import export

    out, _, _ = scripted
    done = export(out, "crl", {"adapter": tmp_path / "crl"})
    ours = load_file(str(done["adapter"] / "adapter_model.safetensors"))
    run = load_file(str(out / "adapters" / "crl" / "adapter_model.safetensors"))
    assert ours.keys() == run.keys() and all(torch.equal(ours[k], run[k]) for k in run)


def test_report_shows_the_validation_curves(scripted):
    out, _, _ = scripted
    sec = next(s for s in R.report_sections(out) if s.title.startswith("Choosing the step"))
    rows = sec.children[0].table
    # validation numbers are selection, not results: the results table carries none of them
    table = next(s for s in R.report_sections(out) if s.title == "ASR and utility per model").table
    assert not any("val" in k for r in table for k in r)
    assert {r["defence"] for r in rows} == {"rr", "crl", "crl_adv"}
    assert [r["step"] for r in rows if r["chosen"]] == [2, 2, 2]
    assert [r["val_benign_compliance"] for r in rows if r["defence"] == "crl"] == SCRIPT


def test_resume_after_a_fault_mid_training_ends_with_the_same_selection(tmp_path, monkeypatch):
    """A run that dies in CRL's step 4 (after the step-3 validation point, before the step-4 checkpoint) and is
    resumed ends with the uninterrupted run's validation history, choice, snapshots and exported adapter."""
    from reprlab.methods.crl_safety import trainer as T

    def run(folder, fault=False):
        cfg = _cfg(tmp_path, ["refusal", "crl"])
        if fault:
            real = T.Trainer.loss

            def loss(self, step):
                if self.kind == "crl" and step == 3:
                    raise KeyboardInterrupt
                return real(self, step)

            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(T.Trainer, "loss", loss)
                with pytest.raises(KeyboardInterrupt):
                    R.run(cfg, Run.create(folder, cfg, "crl-tiny", quiet=True))
            assert (folder / "selection" / "crl" / "step_00000003.json").exists()
            assert not (folder / "selection" / "crl" / "step_00000004.json").exists()
            return R.run(cfg, Run.create(folder, cfg, "crl-tiny", resume=True, quiet=True))
        return R.run(cfg, Run.create(folder, cfg, "crl-tiny", quiet=True))

    whole = run(tmp_path / "whole")
    cut = run(tmp_path / "cut", fault=True)
    drop = ("seconds",)
    assert {k: v for k, v in cut.items() if k not in drop} == {
        k: v for k, v in whole.items() if k not in drop
    }
    a, b = (read_stage(d / "stages" / "select_crl.json") for d in (tmp_path / "whole", tmp_path / "cut"))
    assert a == b
    for step in (1, 2, 3, 4):
        sa, sb = (load_file(str(d / "selection" / "crl" / f"step_{step:08d}.safetensors"))
                  for d in (tmp_path / "whole", tmp_path / "cut"))  # fmt: skip
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    ea, eb = (load_file(str(d / "adapters" / "crl" / "adapter_model.safetensors"))
              for d in (tmp_path / "whole", tmp_path / "cut"))  # fmt: skip
    assert all(torch.equal(ea[k], eb[k]) for k in ea)


SELECTION_KEYS = (".selected_step", ".val_benign_compliance", ".val_asr_prefill")


def test_validation_points_leave_training_as_it_was(tmp_path):
    """With rule 'last' the exported adapter is bitwise the one of a run without validation prompts: measuring and
    snapshotting draws no random number and leaves the adapters in training mode (LoRA dropout 0.05 is on)."""
    on = _cfg(tmp_path, ["crl"], rule="last")
    off = load_config(R.Config, {**TINY, "models": ["crl"],
                                 "data": {**TINY["data"], "user_jsonl": compliant_jsonl(tmp_path)},
                                 "defense": {**TINY["defense"], "optim": {"steps": 4, "batch_size": 2,
                                                                          "checkpoint_every": 2}}})  # fmt: skip
    s_on = R.run(on, Run.create(tmp_path / "on", on, "crl-tiny", quiet=True))
    s_off = R.run(off, Run.create(tmp_path / "off", off, "crl-tiny", quiet=True))
    assert s_on["crl.selected_step"] == 4 and "crl.selected_step" not in s_off
    ea, eb = (
        load_file(str(tmp_path / d / "adapters" / "crl" / "adapter_model.safetensors")) for d in ("on", "off")
    )
    assert ea.keys() == eb.keys() and all(torch.equal(ea[k], eb[k]) for k in ea)
    assert {k: v for k, v in s_off.items() if k != "seconds"} == {
        k: v for k, v in s_on.items() if k != "seconds" and not k.endswith(SELECTION_KEYS)
    }
