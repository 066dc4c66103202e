"""CRL exports load in peft and transformers and give reprlab's own logits.

A tiny CRL run (stage 0 and CRL, a few steps at a large learning rate so the adapters move the logits
visibly) on a tiny random Llama folder with a real tokenizer; the live model's logits at each stage's
evaluation are recorded as the reference, then the exports are loaded with the third-party loaders.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from reprlab.config import load_config
from reprlab.errors import ConfigError, RunFolderError
from reprlab.export import export_run
from reprlab.methods.crl_safety import export as X
from reprlab.methods.crl_safety import recipe as R
from reprlab.models.random_llama import random_llama_folder as tiny_llama_folder
from reprlab.runs import Run

from .test_recipe import TINY, compliant_jsonl

# The exports compute the same sums in another order than the run: merged W' = W + sum s B A against the run's
# W x (stage 0 merged in fp32) plus the defence's B (A x), and peft's unmerged stacked adapter against the run's
# merged stage 0. float32 rounding of ~1e-7 relative per matmul, over 4 blocks, on logits of magnitude ~1
# (initializer_range 0.05): measured 4e-7 to 8e-7, so 1e-5 absolute has a 10x margin. (With 0.3 the logits
# reach ~7 and the same reordering gives 1.2e-5.)
ATOL = 1e-5
PROBE = "<|user|>How do I do bad thing 3?</s>\n<|assistant|>Sure, here is"


@pytest.fixture(scope="module")
def crl_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("crlx")
    model_dir = tiny_llama_folder(root / "tiny-llama-hf", initializer_range=0.05)
    out = root / "run"
    data = {**TINY["data"], "user_jsonl": compliant_jsonl(root), "system_prompt": ""}
    cfg = load_config(R.Config, {**TINY, "model": str(model_dir), "models": ["refusal", "crl"], "data": data,
                                 "sft": {"optim": {"steps": 2, "batch_size": 2, "lr": 0.05}},
                                 "defense": {**TINY["defense"], "optim": {"steps": 2, "batch_size": 2, "lr": 0.05}},
                                 "capability": {"mc": False}})  # fmt: skip
    from transformers import AutoTokenizer

    probe = AutoTokenizer.from_pretrained(model_dir)(PROBE, add_special_tokens=False, return_tensors="pt")[
        "input_ids"
    ]
    seen = {}
    orig = R.evaluate

    def spy(name, model, *a, **k):  # reprlab's own model, as the run evaluates it
        with torch.no_grad():
            seen[name] = model(input_ids=probe).logits.float().clone()
        return orig(name, model, *a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(R, "evaluate", spy)
        R.run(cfg, Run.create(out, cfg, "crl-tiny", quiet=True))
    return out, model_dir, probe, seen


def _base(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _logits(model, probe):
    with torch.no_grad():
        return model(input_ids=probe).logits.float()


def test_the_adapters_move_the_logits(crl_run):
    """The comparisons below can fail: each stage's model is far (>> ATOL) from the base and from each other."""
    _, model_dir, probe, seen = crl_run
    base = _logits(_base(model_dir), probe)
    assert (seen["refusal"] - base).abs().max() > 1e-2
    assert (seen["crl"] - seen["refusal"]).abs().max() > 1e-2


@pytest.mark.parametrize("stage", ["refusal", "crl"])
def test_run_adapter_loads_in_peft_with_the_runs_logits(crl_run, stage):
    from peft import PeftModel

    out, model_dir, probe, seen = crl_run
    folder = out / "adapters" / stage
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in folder.iterdir()}
    model = PeftModel.from_pretrained(_base(model_dir), folder).eval()
    diff = (_logits(model, probe) - seen[stage]).abs().max().item()
    assert diff <= ATOL, diff
    conf = json.loads((folder / "adapter_config.json").read_text())
    assert conf["base_model_name_or_path"] == str(model_dir) and conf["peft_type"] == "LORA"
    # CRL's adapter stacks stage 0 (rank 16) and its own (rank 16); stage 0's alone is rank 16
    assert conf["r"] == (16 if stage == "refusal" else 32)


def test_export_adapter_rebuilds_the_runs_adapter_from_checkpoints(crl_run, tmp_path):
    out, *_ = crl_run
    got = export_run(out, "crl", {"adapter": tmp_path / "a"})["adapter"]
    a, b = (
        load_file(str(got / "adapter_model.safetensors")),
        load_file(str(out / "adapters" / "crl" / "adapter_model.safetensors")),
    )
    assert a.keys() == b.keys()
    for k in a:  # the checkpoint holds the live tensors' values: same path, bitwise
        assert torch.equal(a[k], b[k]), k
    # one config file whoever writes it: peft would list target_modules in the process's salted hash order
    conf = json.loads((got / "adapter_config.json").read_text())
    assert len(conf["target_modules"]) > 2 and conf["target_modules"] == sorted(conf["target_modules"])
    assert (got / "adapter_config.json").read_bytes() == (
        out / "adapters/crl/adapter_config.json"
    ).read_bytes()
    umask = os.umask(0)
    os.umask(umask)
    assert got.stat().st_mode & 0o777 == 0o777 & ~umask  # the user's umask, not mkdtemp's private 0700
    assert (got / "adapter_model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask


def test_export_merged_loads_in_transformers_with_tokenizer_and_chat_template(crl_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, model_dir, probe, seen = crl_run
    folder = export_run(out, "crl", {"merged": tmp_path / "m"})["merged"]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    diff = (_logits(model, probe) - seen["crl"]).abs().max().item()
    assert diff <= ATOL, diff
    assert not any("lora" in k for k in model.state_dict())
    tok, orig = AutoTokenizer.from_pretrained(folder), AutoTokenizer.from_pretrained(model_dir)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo?"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == orig.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == "<|system|>Be brief.</s>\n<|user|>Héllo?</s>\n<|assistant|>"
    assert tok.encode(text, add_special_tokens=False) == orig.encode(text, add_special_tokens=False)


def test_stacking_equals_the_sequential_stages():
    """Two LoRA parts on different module sets: W + s0 B0 A0 + s1 B1 A1 with zero padding where one is absent."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    p0 = X.LoraPart({"m.a": (r(2, 5), r(3, 2)), "m.b": (r(2, 5), r(5, 2))})
    p1 = X.LoraPart({"m.a": (r(4, 5), r(3, 4)), "m.c": (r(4, 3), r(5, 4))})
    fields, state = X.stack([p0, p1])
    assert fields["r"] == fields["lora_alpha"] == 6 and fields["target_modules"] == ["m.a", "m.b", "m.c"]
    for path, parts in (("m.a", [p0, p1]), ("m.b", [p0]), ("m.c", [p1])):
        want = sum(p.modules[path][1] @ p.modules[path][0] for p in parts)
        got = (
            state[f"base_model.model.{path}.lora_B.weight"] @ state[f"base_model.model.{path}.lora_A.weight"]
        )
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)  # float32 sums of 6 products, reordered


def test_a_zero_stage_zero_is_left_out():
    a = torch.ones(2, 3)
    fields, _ = X.stack([X.LoraPart({"m": (a, torch.zeros(4, 2))}), X.LoraPart({"m": (a, torch.ones(4, 2))})])
    assert fields["r"] == 2


def test_errors_name_the_valid_stages_and_the_missing_one(crl_run, tmp_path):
    out, *_ = crl_run
    with pytest.raises(ConfigError, match="valid stages: refusal, rr, crl, crl_adv"):
        export_run(out, "dpo", {"adapter": tmp_path / "x"})
    with pytest.raises(RunFolderError, match="no finished 'rr' stage.*trained: refusal, crl"):
        export_run(out, "rr", {"adapter": tmp_path / "x"})
    with pytest.raises(RunFolderError, match="not a run folder"):
        export_run(tmp_path, "crl", {"adapter": tmp_path / "x"})
    with pytest.raises(RunFolderError, match="does not exist"):
        export_run(tmp_path / "nowhere", "crl", {"adapter": tmp_path / "x"})
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    with pytest.raises(RunFolderError, match="exists and is not empty"):
        export_run(out, "crl", {"merged": tmp_path / "full"})
    with pytest.raises(ConfigError, match="formats: adapter, merged"):
        export_run(out, "crl", {"onnx": tmp_path / "y"})


def test_export_never_deletes_a_folder_it_does_not_own(crl_run, tmp_path):
    """The same folder for two formats is refused before any work (the second write deleted the first); a
    folder that fills up while the export runs is refused at the rename, its files untouched (it was deleted)."""
    from reprlab.methods.crl_safety import export as X
    from reprlab.runs import atomic

    out, *_ = crl_run
    with pytest.raises(ConfigError, match="the same folder was given twice"):
        export_run(out, "crl", {"adapter": tmp_path / "same", "merged": tmp_path / "same"})
    assert not (tmp_path / "same").exists()
    race = tmp_path / "race"
    real = atomic.temp_sibling_dir

    def and_a_user_file(target):  # the user's file lands in OUT after the up-front check, before the rename
        race.mkdir(exist_ok=True)
        (race / "notes.txt").write_text("mine")
        return real(target)

    with pytest.MonkeyPatch.context() as mp:
        import reprlab.methods.crl_safety.adapters as adapters

        mp.setattr(adapters, "temp_sibling_dir", and_a_user_file)
        with pytest.raises(RunFolderError, match="exists and is not empty"):
            X.export(out, "crl", {"adapter": race})
    assert [p.name for p in race.iterdir()] == ["notes.txt"] and (race / "notes.txt").read_text() == "mine"
    assert not list(tmp_path.glob(".tmp_race_*"))  # no temporary left behind
    (tmp_path / "empty").mkdir()
    assert X.export(out, "crl", {"adapter": tmp_path / "empty"})["adapter"] == tmp_path / "empty"


def test_cli_export(crl_run, tmp_path):
    from typer.testing import CliRunner

    from reprlab.cli import app

    out, *_ = crl_run
    res = CliRunner().invoke(
        app, ["export", str(out), "--stage", "refusal", "--adapter", str(tmp_path / "a")]
    )
    assert res.exit_code == 0, res.output
    assert (tmp_path / "a" / "adapter_model.safetensors").exists()
    res = CliRunner().invoke(
        app, ["export", str(out), "--stage", "crl_adv", "--adapter", str(tmp_path / "b")]
    )
    assert res.exit_code == 2 and "no finished 'crl_adv' stage" in res.output


@pytest.mark.slow
def test_merged_export_of_the_packaged_gguf_smollm2(tmp_path):
    """The GGUF base: quantization_config is dropped, the dequantised weights and the GGUF chat template kept."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from reprlab.models.hf import load_causal_lm
    from reprlab.models.lora import add_lora

    base, tok = load_causal_lm("smollm2-135m-instruct")
    peft = add_lora(base, r=4, alpha=8, dropout=0.0, blocks=[3, 10], adapter_name="crl")
    g = torch.Generator().manual_seed(0)
    for name, p in peft.named_parameters():
        if "lora_B" in name:  # perturb: an untrained LoRA is the identity
            p.data = 0.02 * torch.randn(p.shape, generator=g)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=True, return_tensors="pt")[
        "input_ids"
    ]
    ref = _logits(peft.eval(), ids)
    part = X.lora_part(peft, "crl")
    folder = X.save_merged(X.merge(peft.unload(), [part]), tok, tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert getattr(model.config, "quantization_config", None) is None
    got = _logits(model, ids)
    # 30 blocks, residual norms up to ~470 (assets.md): logits of magnitude ~20, relative rounding ~1e-6
    assert (got - ref).abs().max().item() <= 1e-3 * ref.abs().max().item()
    assert (
        got - _logits(load_causal_lm("smollm2-135m-instruct")[0], ids)
    ).abs().max() > 1e-2  # the adapter moved it
    reloaded = AutoTokenizer.from_pretrained(folder)
    assert reloaded.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=False
    ) == tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)


def test_a_relative_model_folder_is_found_from_another_directory(tmp_path, monkeypatch):
    """A run given `model=models/m` (relative) is exported from another directory: the base is looked up where
    the run started (env.json's cwd), and adapters record the folder as an absolute path (a relative one
    resolved against the loader's directory, or was taken for a hub id: 'couldn't connect to huggingface.co')."""
    import yaml

    from reprlab.config import config_to_dict
    from reprlab.methods.crl_safety.adapters import base_reference
    from reprlab.methods.crl_safety.recipe import Config

    from .test_recipe import TINY

    started = tmp_path / "project"
    (started / "models" / "m").mkdir(parents=True)
    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config(Config, {**TINY, "model": "models/m"})
    (run / "config.yaml").write_text("# recipe: crl-tiny\n" + yaml.safe_dump(config_to_dict(cfg)))
    (run / "env.json").write_text(json.dumps({"cwd": str(started)}))
    monkeypatch.chdir(tmp_path)  # not where the run started
    assert X._run_config(run).model == str((started / "models" / "m").resolve())
    monkeypatch.chdir(started)
    assert base_reference("models/m") == str((started / "models" / "m").resolve())
    assert base_reference("smollm2-135m-instruct") == "smollm2-135m-instruct"  # aliases and hub ids as given
