"""Reason to Rote on Hugging Face causal LMs: every analysis through ``hooks.sites``.

* A GPT-2 converted from our GPT (``to_hf_gpt2``: pre-LN, GELU MLP, learned positions, untied embeddings)
  behind ``HFCausalLM`` gives our GPT's logits and, analysis by analysis, our GPT's numbers (to 1e-4): the
  independent oracle is our own GPT, whose hooks are its own ``HookPoint`` modules, not the HF adapter.
* Tiny random ``LlamaForCausalLM`` and ``GPT2LMHeadModel`` (built from a config folder, no download),
  trained briefly, run every analysis to finite, non-trivial outputs.
"""

import math

import numpy as np
import pytest
import torch

from reprlab.errors import ConfigError
from reprlab.methods.reason_to_rote import analyses as A
from reprlab.methods.reason_to_rote.dataset import Vocab, tensorize
from reprlab.methods.reason_to_rote.fda import FDA_VOCAB, FDAConfig, generate_fda
from reprlab.methods.reason_to_rote.lm import build_lm, token_map
from reprlab.methods.reason_to_rote.train import answer_loss
from reprlab.models.gpt import GPT, GPTConfig, to_hf_gpt2
from reprlab.models.hf_lm import HFCausalLM

V = Vocab(FDA_VOCAB, "char")
# float32, two code paths (our fused qkv + padded SDPA vs HF GPT-2's attention; measured max |Δlogit| ~1e-6):
# the analyses' numbers must agree to 1e-4, our tolerance for a converted model, relative above 1: a z-score of
# 32 is a ratio of float32 sums, and 5e-4 apart between the two paths alone on this AVX2 EPYC (1.5e-5 relative)
TOL = 1e-4


class Data:
    def __init__(self):
        ds = generate_fda(FDAConfig(n_train=240, n_test=100, noise_rate=0.1, noise_mode="digit"), seed=0)
        tr, te = ds.splits["train"], ds.splits["test"]
        self.train = tensorize(tr, V)
        self.clean_items = [it for it in tr if not it.noisy]
        self.noisy_items = [it for it in tr if it.noisy]
        self.test_items = te
        self.clean, self.noisy, self.test = (
            tensorize(x, V) for x in (self.clean_items, self.noisy_items, self.test_items)
        )


@pytest.fixture(scope="module")
def data():
    return Data()


def _fit(model, data: Data, steps: int, lr: float) -> None:
    """Full-batch AdamW on the noisy training set with the recipe's answer-only loss (memorises part of it)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        loss = answer_loss(model, data.train)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


@pytest.fixture(scope="module")
def pair(data):
    """(our GPT trained until part of the noisy labels are memorised, the same weights as a HF GPT-2)."""
    torch.manual_seed(0)
    ours = GPT(GPTConfig(d_vocab=len(V), n_ctx=16, n_layers=2, d_model=32, n_heads=4, d_mlp=64))
    _fit(ours, data, steps=350, lr=1e-2)
    torch.manual_seed(1)
    untrained = GPT(ours.cfg).eval()
    return (ours, untrained), (HFCausalLM(to_hf_gpt2(ours).eval()), HFCausalLM(to_hf_gpt2(untrained).eval()))


def _close(a, b, path="", off=None):
    """Assert two analysis outputs (nested dicts/lists of numbers and labels) agree to TOL; numbers that
    differ by more are appended to ``off`` instead when it is given."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _close(a[k], b[k], f"{path}.{k}", off)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{path}[{i}]", off)
    elif isinstance(a, (float, int, np.floating, np.integer)) and not isinstance(a, bool):
        scale = max(1.0, abs(a)) if isinstance(a, float | np.floating) else 1.0  # counts stay exact to TOL
        ok = (math.isnan(a) and math.isnan(b)) or abs(a - b) <= TOL * scale
        if off is not None and not ok:
            off.append((path, a, b))
        else:
            assert ok, (path, a, b)
    else:
        assert a == b, (path, a, b)


_PROBES: dict[int, dict] = {}  # probes per model (INLP reads the cells they chose); fits are the slow part


def _run(name: str, model, untrained, data: Data) -> dict:
    d = data
    if name == "logit_lens":
        return A.run_logit_lens(model, d.noisy)
    if name in ("probes", "inlp"):
        if id(model) not in _PROBES:
            _PROBES[id(model)] = A.run_probes(model, untrained, d.clean, d.clean_items, d.test, d.test_items,
                                              d.noisy, d.noisy_items, 0)  # fmt: skip
        probes = _PROBES[id(model)]
        return (
            probes
            if name == "probes"
            else A.run_inlp(model, probes, d.clean, d.clean_items, d.test, d.noisy, 4, 0)
        )
    if name == "edge_circuits":
        return A.run_edge_circuits(model, d.clean, d.noisy, 0.2, 24, 0)
    if name == "head_ablation":
        return A.run_head_ablation(model, d.clean, d.noisy, 24, 0)
    summary, scores = A.run_circuits(model, d.clean, d.noisy, 0.05, 24, 0)
    if name == "circuits":
        return {**summary, "scores": scores}
    return A.run_neurons(model, scores, d.clean, d.clean_items, d.test, d.test_items, d.noisy, d.noisy_items,
                         "reversed", 8, 1, 0, 3)  # fmt: skip


def test_converted_gpt2_has_our_logits_and_untied_embeddings(pair, data):
    (ours, _), (hf, _) = pair
    with torch.no_grad():
        a, b = ours(data.train.ids), hf(data.train.ids)
    assert (a - b).abs().max().item() < TOL
    assert a.abs().max().item() > 5  # trained logits, not near-zero ones that agree trivially
    emb, head = hf.hf_model.transformer.wte.weight, hf.hf_model.lm_head.weight
    assert emb.data_ptr() != head.data_ptr() and not torch.equal(emb, head)
    # the memorisation the analyses look at is there: part of the noisy labels, same on both models
    em = lambda m: A.answer_matches(m, data.noisy.ids, data.noisy).all(1).float().mean().item()  # noqa: E731
    assert 0.5 < em(ours) == em(hf)


@pytest.mark.parametrize(
    "name", ["logit_lens", "probes", "inlp", "circuits", "edge_circuits", "head_ablation", "neurons"]
)
def test_analysis_agrees_between_our_gpt_and_its_gpt2_conversion(pair, data, name):
    (ours, ours_untrained), (hf, hf_untrained) = pair
    a, b = _run(name, ours, ours_untrained, data), _run(name, hf, hf_untrained, data)
    if name != "probes":
        _close(a, b, name)
        return
    # The probe grids hold accuracies of scikit-learn fits that stop at max_iter on separable cells, where a
    # 1e-6 change of the activations moves a borderline prediction: measured, 2 of the 558 grid accuracies
    # differ by one item (1/50, 1/24). So the grids may differ by one item in a few cells; everything the probes
    # report (chosen cells, their accuracies, selectivity, the controls) agrees to TOL.
    a, b = dict(a), dict(b)  # the cached probes stay whole for the INLP test
    grids_a, grids_b = a.pop("grids"), b.pop("grids")
    _close(a, b, name)
    off: list = []
    _close(grids_a, grids_b, "grids", off)
    n_sel = a["n_select"]
    sizes = {
        "clean_select": n_sel,
        "acc_shuffled": n_sel,
        "clean_test": a["n_report"],
        "noisy": len(data.noisy),
    }
    assert len(off) <= 4, off
    for path, x, y in off:
        assert abs(x - y) <= 1 / sizes[path.split(".")[-1].split("[")[0]] + TOL, (path, x, y)


def test_start_returns_the_answer_span_of_the_full_logits(pair, data):
    _, (hf, _) = pair
    with torch.no_grad():
        full, tail = hf(data.train.ids), hf(data.train.ids, start=9)
    torch.testing.assert_close(tail, full[:, 9:], atol=1e-5, rtol=0)  # one lm_head matmul on fewer rows


def _tiny_config_folder(kind: str, folder):
    from transformers import GPT2Config, LlamaConfig

    if kind == "llama":
        LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=32).save_pretrained(folder)  # fmt: skip
    else:
        GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4, n_inner=64,
                   bos_token_id=0, eos_token_id=0).save_pretrained(folder)  # fmt: skip
    return str(folder)


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def untrained_hf(request, tmp_path_factory):
    """A tiny random HF causal LM built from a config folder (no download), with the task's token ids."""
    folder = _tiny_config_folder(request.param, tmp_path_factory.mktemp(request.param))
    return build_lm(folder, from_config=True, tokens="auto", vocab=V, n_ctx=16, seed=0)


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def trained_hf(request, tmp_path_factory, data):
    """The same, trained like ``pair``'s GPT until it memorises part of the noisy labels."""
    folder = _tiny_config_folder(request.param, tmp_path_factory.mktemp(request.param))
    lm = build_lm(folder, from_config=True, tokens="auto", vocab=V, n_ctx=16, seed=0)
    _fit(lm.model, data, steps=350, lr=1e-2)
    return lm


ANALYSES = ["logit_lens", "probes", "inlp", "circuits", "edge_circuits", "head_ablation", "neurons"]


def _numbers(x) -> list[float]:
    if isinstance(x, dict):
        return [v for y in x.values() for v in _numbers(y)]
    if isinstance(x, (list, tuple)):
        return [v for y in x for v in _numbers(y)]
    return [float(x)] if isinstance(x, (float, int)) and not isinstance(x, bool) else []


def test_tiny_hf_model_is_built_from_its_config_with_the_task_vocabulary(untrained_hf):
    lm = untrained_hf
    assert lm.info["tokens"] == "task" and lm.info["n_layers"] == 2
    assert lm.model.config.vocab_size == len(V)
    assert lm.token_map.tolist() == list(range(len(V)))
    assert all(m.p == 0 for m in lm.model.modules() if isinstance(m, torch.nn.Dropout))
    # the untrained control is another draw of the same architecture
    other = lm.untrained()
    assert type(other.hf_model) is type(lm.model.hf_model)
    assert not torch.equal(
        other.hf_model.get_input_embeddings().weight, lm.model.hf_model.get_input_embeddings().weight
    )


@pytest.mark.parametrize("name", ANALYSES)
def test_every_analysis_runs_on_untrained_tiny_hf_models(untrained_hf, data, name):
    nums = _numbers(_run(name, untrained_hf.model, untrained_hf.untrained(), data))
    assert nums and all(math.isfinite(v) for v in nums if v == v), name
    assert len(set(nums)) > 1, name  # not one constant (all zeros) everywhere


@pytest.mark.slow
@pytest.mark.parametrize("name", ANALYSES)
def test_every_analysis_gives_non_trivial_outputs_on_trained_tiny_hf_models(trained_hf, data, name):
    out = _run(name, trained_hf.model, trained_hf.untrained(), data)
    assert all(math.isfinite(v) for v in _numbers(out) if v == v), name
    # non-trivial: the number each analysis exists for moves off its degenerate value on a trained model
    if name == "logit_lens":  # the memorised noisy label overtakes the true answer at the output
        assert out["share_a_above_b"][-1] < 0.9 and max(out["mean_prob_b"]) > 0.2
    elif name == "probes":
        # some target decoded above its majority rate at its chosen leak-free cell, on the selection split: these
        # tiny models memorise the training set (noisy 1.0) without generalising (clean test EM 0), so held-out
        # carry accuracy sits at the majority rate (0.03-0.13 above it across thread counts and CPUs) and is no
        # stable test of the probes
        assert max(b["acc_clean_select"] - b["majority"] for b in out["best"].values()) > 0.1
    elif name == "inlp":
        # INLP removes directions where a probe finds one (not at every cell of a model that did not generalise)
        assert any(c["rank"] > 0 for c in out["cells"]) and out["before"]["noisy_memorized"] > 0.2
    elif name in ("circuits", "edge_circuits"):
        assert 0 < out["iou"] <= 1 and 0 < out["iou_null_unrelated"] <= 1
        assert math.isfinite(out["faithfulness_memorization"])
        if name == "circuits":
            assert any(np.abs(np.array(s)).max() > 0 for s in out["scores"].values())
    elif name == "head_ablation":
        assert np.abs(np.array(out["effect_memorization"]["effect"])).max() > 1e-3
    else:  # neurons
        assert out["z_noisy_abs"] > 0 and out["memorized_before"] > 0.2 and len(out["neurons"]) == 8


class _OneTokenPerByte:
    """A tokenizer with one token per byte (ids 3..258) and a leading-space word form: enough for token_map."""

    eos_token_id, pad_token_id = 2, None

    def encode(self, text, add_special_tokens=False):
        return [b + 3 for b in text.encode()]


def test_token_map_encodes_each_task_token_alone():
    ids, new = token_map(V, _OneTokenPerByte(), "tokenizer", vocab_size=259)
    assert ids[:10] == [ord(c) + 3 for c in "0123456789"] and ids[10:12] == [ord("+") + 3, ord("=") + 3]
    assert ids[12] == ids[13] == 2 and new == []  # <eos> -> EOS; <pad> -> EOS when the tokenizer has no pad
    # THR words: several bytes -> a new token each, numbered after the model's vocabulary
    words = Vocab(["who", "a", "<eos>", "<pad>"], "word")
    ids, new = token_map(words, _OneTokenPerByte(), "tokenizer", vocab_size=259)
    assert new == ["who", "a"] and ids == [259, 260, 2, 2]  # " a" is two bytes too
    with pytest.raises(ValueError, match="task vocabulary"):
        token_map(V, None, "task", vocab_size=10)


def test_token_map_refuses_a_tokenizer_whose_ids_pass_the_models_embedding():
    """A tokenizer from another model gives ids past the embedding: an IndexError mid-run, or, when the id falls
    among the rows added for new THR words, two task tokens silently sharing one row. Refused, naming the token."""
    with pytest.raises(ConfigError, match=r"gives '0' the id 51, but the model has 40 embedding rows"):
        token_map(V, _OneTokenPerByte(), "tokenizer", vocab_size=40)
    far_eos = type("FarEos", (_OneTokenPerByte,), {"eos_token_id": 300})()
    with pytest.raises(ConfigError, match=r"gives '<eos>' the id 300, but the model has 259"):
        token_map(V, far_eos, "tokenizer", vocab_size=259)


def test_unrelated_metric_reads_the_models_digit_ids():
    at = torch.full((50,), 11)
    digits = torch.arange(10) + 32  # SmolLM2's ids of 0..9
    plain = A._unrelated_metric(at, torch.Generator().manual_seed(0))
    mapped = A._unrelated_metric(at, torch.Generator().manual_seed(0), digits)
    # the same random digit pairs, in the model's ids
    assert torch.equal(mapped.target, digits[plain.target]) and torch.equal(
        mapped.alternative, digits[plain.alternative]
    )
    assert (mapped.target != mapped.alternative).all()


@pytest.mark.slow
def test_smollm2_token_map_is_the_tokenizers_own_encoding():
    # the packaged SmolLM2 tokenizer splits digits individually, so encoding each FDA character alone gives
    # exactly its encoding of the whole item (prompt + answer + EOS); THR words with a leading space are mostly
    # one token of its vocabulary, the others new tokens
    from transformers import AutoTokenizer

    from reprlab.methods.reason_to_rote.thr import THRConfig, generate_thr
    from reprlab.models.hf import _resolve

    path, kwargs = _resolve("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(path, **kwargs)
    ids, new = token_map(V, tok, "tokenizer", vocab_size=len(tok))
    assert new == [] and len(set(ids[:12])) == 12
    ds = generate_fda(FDAConfig(n_train=200, n_test=10), seed=0)
    m = torch.tensor(ids)
    for it in ds.splits["train"]:
        own = tok.encode(it.prompt + it.train_answer, add_special_tokens=False) + [tok.eos_token_id]
        assert m[tensorize([it], V).ids[0]].tolist() == own, it
    thr = generate_thr(THRConfig(n_people=30, n_orgs=6), seed=0)
    words = Vocab(thr.manifest["vocab"], thr.manifest["tokenizer"])
    ids, new = token_map(words, tok, "tokenizer", vocab_size=len(tok))
    assert len(set(ids)) == len(words) - 1  # <eos> and <pad> share the EOS id; every word has its own id
    assert all(i >= len(tok) for i, w in zip(ids, words.tokens) if w in new)


def test_the_saved_model_gets_its_tokenizer_only_where_the_tokenizer_encodes_the_task_as_trained(tmp_path):
    """THR words the tokenizer splits get new embedding rows the tokenizer does not know: saved beside the model,
    it would split them into its own pieces (" ceo" -> two ids, where the model learnt one row). Then only
    task_tokens.json maps the words; with every word the tokenizer's own id, the tokenizer is saved."""
    import json
    from types import SimpleNamespace

    from transformers import GPT2Config, GPT2LMHeadModel

    from reprlab.methods.reason_to_rote.lm import save_lm
    from tests.unit.models.test_model_files import _tokenizer

    _tokenizer(tmp_path / "tok", chat=False)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=16, n_embd=8, n_layer=1, n_head=2))
    for new, saved in ((["juchoslabs"], False), ([], True)):
        info = {"tokens": "tokenizer", "new_tokens": new, "token_ids": {"the": 2, "juchoslabs": 10}}
        out = save_lm(
            SimpleNamespace(model=SimpleNamespace(hf_model=hf), tokenizer=tok, info=info),
            tmp_path / str(saved),
        )
        assert bool(list((tmp_path / str(saved)).glob("tokenizer*"))) is saved, out
        assert json.loads((tmp_path / str(saved) / "task_tokens.json").read_text()) == info["token_ids"]


def test_reprlab_export_of_a_rote_run_points_at_the_model_it_already_saved(tmp_path):
    """Rote has no exporter: `reprlab export` names the methods that have one and, where the run trained a HF
    model, the folder that already holds it (the user looked for it under export)."""
    from reprlab.errors import ConfigError
    from reprlab.export import exporter_of

    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    (run / "config.yaml").write_text("# recipe: rote-fda-tiny\nseed: 0\n")
    with pytest.raises(ConfigError, match="which has no exporter") as err:
        exporter_of(run)
    assert err.value.hint is None  # our GPT's run: no model folder to point at
    (run / "model" / "config.json").write_text("{}")
    with pytest.raises(ConfigError) as err:
        exporter_of(run)
    assert f"{run / 'model'} already holds its trained model" in err.value.hint
