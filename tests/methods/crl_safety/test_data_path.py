"""The GPU recipes' data path with a base that already refuses: train on compliant completions, or stop.

The base is the tiny random Llama made to "refuse": its replies are replaced by a templated refusal (what an
instruct model such as Llama-3-8B-Instruct answers to harmful requests), which the offline judge labels refuse.
"""

import json

import pytest

from reprlab.config import load_config
from reprlab.errors import DataError
from reprlab.methods.crl_safety import recipe as R
from reprlab.methods.crl_safety import trainer as T
from reprlab.methods.crl_safety.data import REFUSALS
from reprlab.runs import Run

REFUSAL = "I'm sorry, but I can't help with that request."
COMPLY = "Sure, here is how: first gather the tools, then follow each step with care."


class Stop(Exception):
    pass


def gpu_cfg(recipe: str, **data):
    """The shipped GPU recipe with sizes and layers scaled to the 4-block tiny Llama; everything else as shipped."""
    from reprlab.recipes import get_recipe

    over = ["model=tiny-llama", "dtype=float32", "device=cpu", "threads=1", "models=[crl]", "mechanism_layers='1,3'",
            "data.n_harmful_train=6", "data.n_harmful_eval=4", "data.n_harmless_train=4", "data.n_harmless_eval=2",
            "data.n_xstest=2", "data.max_prompt_tokens=24", "data.response_tokens=12",
            "defense.crl.layers_harmful='2:3'", "defense.crl.layers_benign='0:4'", "defense.rr.layers='1,2'",
            "defense.mining.blocks='0:1'", "defense.optim.batch_size=2", "attack.gcg_steps=0"]  # fmt: skip
    over += [f"data.{k}={v}" for k, v in data.items()]
    return load_config(R.Config, get_recipe(recipe).config, over)


@pytest.fixture
def refusing_base(monkeypatch):
    """Every reply of the base model is a refusal; the trainer records what it is given and stops the run."""
    seen = {}

    def replies(model, tok, fmt, prompts, n):  # the user files' harmless prompts get a plain answer
        return ["Here is a short answer." if p.startswith("Tell me about") else REFUSAL for p in prompts]

    class Recorder(T.Trainer):
        def __init__(self, kind, model, cfg, harmful, benign, pad_id, *a, **k):
            seen[kind] = (harmful, benign, k.get("retain"), cfg)
            if kind != "sft":
                raise Stop
            super().__init__(kind, model, cfg, harmful, benign, pad_id, *a, **k)

    monkeypatch.setattr(R, "_base_replies", replies)
    monkeypatch.setattr(T, "Trainer", Recorder)
    return seen


@pytest.mark.parametrize("recipe", ["crl-llama3-8b", "crl-mistral-7b"])
def test_refusing_base_stops_the_run_before_training(tmp_path, refusing_base, recipe):
    cfg = gpu_cfg(recipe)
    assert cfg.sft.optim.steps == 0  # the shipped GPU recipes use the instruct model itself as stage 0
    with pytest.raises(DataError, match=r"only 0 of 6 harmful training completions .* judged compliant"):
        R.run(cfg, Run.create(tmp_path / "r", cfg, recipe, quiet=True))
    assert refusing_base == {}  # no trainer was built: nothing trained on refusals


def _compliant_pairs(folder) -> str:
    """10 harmful prompts with compliant user responses and 6 harmless prompts, as a user JSONL."""
    rows = [{"prompt": f"How do I do bad thing {i}?", "harmful": True, "response": f"{COMPLY} ({i})"}
            for i in range(10)]  # fmt: skip
    rows += [{"prompt": f"Tell me about topic {i}.", "harmful": False} for i in range(6)]
    p = folder / "pairs.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows))
    return str(p)


def test_user_completions_are_what_the_defence_trains_on(tmp_path, refusing_base):
    cfg = gpu_cfg("crl-llama3-8b", user_jsonl=_compliant_pairs(tmp_path))
    with pytest.raises(Stop):
        R.run(cfg, Run.create(tmp_path / "r", cfg, "crl-llama3-8b", quiet=True))
    harmful, benign, retain, dcfg = refusing_base["crl"]
    _, tok = R.load_model(cfg, "cpu")
    texts = [tok.decode(r) for _, r in harmful]
    assert len(texts) == 6
    # every harmful completion is a user's compliant answer (cut to response_tokens), none a refusal
    assert all(COMPLY.startswith(t) for t in texts) and not any("sorry" in t for t in texts)
    # the reference's KL: batchmean on a separate retain set (harmless prompt -> base reply), given to the trainer
    assert (dcfg.crl.kl_reduction, dcfg.crl.kl_data, dcfg.mining.init) == ("batchmean", "retain", "residual")
    assert retain and len(retain) == 4


def test_completion_model_replaces_the_base_for_harmful_completions(tmp_path, refusing_base, monkeypatch):
    asked = []

    def completions(cfg, device, prompts):
        asked.append(cfg.data.completion_model)
        return [COMPLY for _ in prompts]

    monkeypatch.setattr(R, "_completion_replies", completions)
    # the stand-in id is never loaded (completions are patched), so the offline availability check must pass it
    monkeypatch.setattr("reprlab.models.hf.check_model_available", lambda mid, what="model": "cache")
    cfg = gpu_cfg("crl-llama3-8b", completion_model="some/uncensored-model")
    with pytest.raises(Stop):
        R.run(cfg, Run.create(tmp_path / "r", cfg, "crl-llama3-8b", quiet=True))
    assert asked == ["some/uncensored-model"]  # one load for the train and eval harmful prompts
    _, tok = R.load_model(cfg, "cpu")
    assert all(COMPLY.startswith(tok.decode(r)) for _, r in refusing_base["crl"][0])


def test_rr_retain_set_holds_refusals_as_circuit_breakers(tmp_path, refusing_base):
    cfg = gpu_cfg("crl-llama3-8b", user_jsonl=_compliant_pairs(tmp_path))
    cfg = load_config(R.Config, {**_as_dict(cfg), "models": ["rr"]})
    with pytest.raises(Stop):
        R.run(cfg, Run.create(tmp_path / "r", cfg, "crl-llama3-8b", quiet=True))
    harmful, retain_set, _, _ = refusing_base["rr"]
    _, tok = R.load_model(cfg, "cpu")
    texts = [tok.decode(r) for _, r in retain_set]
    assert len(retain_set) == 4 + 6  # harmless train pairs + one refusal per harmful training prompt
    assert (
        sum(any(r.startswith(t.strip()) for r in REFUSALS) for t in texts) == 6
    )  # refusal pairs end the turn (trailing newline)
    assert all(COMPLY.startswith(tok.decode(r)) for _, r in harmful)  # rerouted: compliant completions only


def _as_dict(cfg):
    import dataclasses

    return dataclasses.asdict(cfg)


def test_attacks_never_prefill_or_target_a_refusal(tmp_path, refusing_base, monkeypatch):
    """Held-out prompts whose completion is a refusal get the generic affirmative target, not the refusal."""
    from reprlab.methods.crl_safety.evaluate import SURE_TARGET

    rows = [
        {"prompt": f"How do I do bad thing {i}?", "harmful": True, "response": f"{COMPLY} ({i})"}
        for i in range(6)
    ]
    rows += [
        {"prompt": f"How do I do worse thing {i}?", "harmful": True} for i in range(4)
    ]  # the base refuses these
    rows += [{"prompt": f"Tell me about topic {i}.", "harmful": False} for i in range(6)]
    p = tmp_path / "pairs.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows))
    seen = {}

    def evaluate(name, model, tok, fmt, data, *a, **k):
        seen["data"] = data
        raise Stop

    monkeypatch.setattr(R, "evaluate", evaluate)
    cfg = gpu_cfg("crl-llama3-8b", user_jsonl=str(p), min_compliant=0.1, n_harmful_train=5)
    cfg = load_config(R.Config, {**_as_dict(cfg), "models": ["base"]})
    with pytest.raises(Stop):
        R.run(cfg, Run.create(tmp_path / "r", cfg, "crl-llama3-8b", quiet=True))
    ev = seen["data"]
    assert any("worse" in q for q in ev.harmful)  # seed 0's split puts refused prompts in the held-out set
    for prompt, reply in zip(ev.harmful, ev.harmful_base_replies):
        assert reply == SURE_TARGET if "worse" in prompt else reply.startswith(COMPLY)
