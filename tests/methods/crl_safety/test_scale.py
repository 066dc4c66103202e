"""Scale: one copy of the base, gradient checkpointing, bf16, FSDP2 under torchrun, memory."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from reprlab.methods.crl_safety.chat import collate, forward
from reprlab.methods.crl_safety.config import CrlCfg, DefenseCfg, LoraCfg, OptimCfg
from reprlab.methods.crl_safety.trainer import Trainer
from reprlab.models.hf import tiny_llama
from reprlab.models.lora import add_lora

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import fsdp_recipe_worker  # noqa: E402
import fsdp_worker  # noqa: E402


def _pairs(fmt, texts, reply):
    return [(fmt.prompt_ids(t), fmt.response_ids(t, reply, end_turn=False)) for t in texts]


@pytest.fixture
def data(fmt):
    harm = _pairs(fmt, [f"do bad thing {i}" + "!" * i for i in range(6)], "Sure, step one")
    ben = _pairs(fmt, [f"nice question {i}" for i in range(6)], "Here is an answer")
    return harm, ben


def _cfg(steps=3, dropout=0.05, **optim):
    return DefenseCfg(optim=OptimCfg(steps=steps, batch_size=3, lr=1e-2, checkpoint_every=100, **optim),
                      lora=LoraCfg(r=4, alpha=8, dropout=dropout),
                      crl=CrlCfg(layers_benign="1:4", layers_harmful="2:4", kl_reduction="batchmean", kl_data="retain"))  # fmt: skip


# ---------------------------------------------------------------------- one copy of the base
def test_frozen_states_with_the_adapter_disabled_equal_a_separately_loaded_base(tiny, data):
    """The trainer's frozen reference (same model, adapter off) is the base, bit for bit, after training moved the
    adapter; so the recipe needs no second copy of the weights."""
    model, _ = tiny
    harm, ben = data
    torch.manual_seed(0)
    peft = add_lora(model, 4, 8, 0.0)
    # no frozen cache: the frozen pass runs now, on the trained model (a cache would hold step 0's states, when the
    # adapter is still a no-op, B = 0)
    tr = Trainer("crl", peft, _cfg(steps=3, cache_frozen=False), harm, ben, 0, seed=0, retain=ben)
    tr.fit()
    other, _ = tiny_llama(seed=0, num_hidden_layers=4, initializer_range=0.3)  # a second load, never trained
    idx = list(range(len(harm)))
    batch = collate(harm, 0)
    frozen, _ = tr._frozen_rows("harmful", harm, idx, batch, logits=False)
    with torch.no_grad():
        out = forward(other, batch.attention_mask, input_ids=batch.input_ids)
        ref = torch.stack([out.hidden_states[i][batch.response_mask] for i in tr.layers["harmful"]])
        with peft.disable_adapter():
            lg_off = forward(peft, batch.attention_mask, input_ids=batch.input_ids, logits_last=None).logits
        lg_base = forward(other, batch.attention_mask, input_ids=batch.input_ids, logits_last=None).logits
        trained = forward(peft, batch.attention_mask, input_ids=batch.input_ids)
    assert torch.equal(frozen, ref)  # same weights, same kernels: bitwise
    assert torch.equal(lg_off, lg_base)
    moved = torch.stack([trained.hidden_states[i][batch.response_mask] for i in tr.layers["harmful"]])
    assert (moved - ref).abs().max() > 1e-3  # not vacuous: with the adapter on, the states did move


# ---------------------------------------------------------------------- gradient checkpointing
def _loss_and_grads(tiny, data, ckpt: bool):
    model, _ = tiny
    harm, ben = data
    torch.manual_seed(0)
    peft = add_lora(model, 4, 8, 0.1)  # dropout on: recomputation must replay the same masks
    tr = Trainer("crl", peft, _cfg(dropout=0.1, cache_frozen=False), harm, ben, 0, seed=0, retain=ben)
    calls = []
    # count SiLU calls inside the blocks: a checkpointed block runs its forward again in backward (module hooks do
    # not fire on the replay, so the instance's forward is wrapped)
    for b in peft.base_model.model.model.layers:
        fw = b.mlp.act_fn.forward
        b.mlp.act_fn.forward = lambda *a, fw=fw: (calls.append(1), fw(*a))[1]
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    tr.checkpointing(ckpt)
    peft.train()
    torch.manual_seed(1)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = tr.loss(0)
    n_fwd = len(calls)
    loss.backward()
    tr.checkpointing(False)
    grads = {n: p.grad.clone() for n, p in peft.named_parameters() if p.requires_grad}
    return loss.item(), grads, n_fwd, len(calls), sum(saved.values())


def test_gradient_checkpointing_gives_the_same_loss_and_gradients(tiny, data):
    base_loss, base_g, fwd0, all0, bytes0 = _loss_and_grads(tiny, data, False)
    fresh = tiny_llama(
        seed=0, num_hidden_layers=4, initializer_range=0.3
    )  # the first run wrapped `tiny` in LoRA
    loss, g, fwd1, all1, bytes1 = _loss_and_grads(fresh, data, True)
    assert all0 == fwd0 and fwd1 == fwd0  # same forward calls; without checkpointing, none in backward
    # checkpointing replays every block of the 3 passes with gradient (harmful, benign, retain) in backward
    assert all1 - fwd1 == 3 * 4
    assert bytes1 < bytes0 / 2  # and autograd kept less than half the bytes (block internals are not saved)
    assert loss == base_loss  # the forward is the same computation
    assert base_g.keys() == g.keys()
    for n in g:
        # recomputation replays the same kernels on the same inputs (RNG state restored, so the same dropout
        # masks): equal up to float32 summation order in the backward, ~1e-7 relative
        assert torch.allclose(g[n], base_g[n], rtol=1e-5, atol=1e-7), n
    assert max(v.abs().max().item() for v in g.values()) > 1e-3  # gradients are not all zero


# ---------------------------------------------------------------------- bf16
def test_bf16_base_trains_fp32_adapters_close_to_fp32(fmt, data):
    harm, ben = data
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        model, _ = tiny_llama(seed=0, num_hidden_layers=4, initializer_range=0.3)
        model = model.to(dtype)
        torch.manual_seed(0)
        peft = add_lora(model, 4, 8, 0.0)
        tr = Trainer("crl", peft, _cfg(steps=2, dropout=0.0), harm, ben, 0, seed=0, retain=ben)
        torch.manual_seed(0)
        loss, info = tr.loss(0)
        loss.backward()
        assert all(p.dtype == torch.float32 for p in tr.params)  # peft keeps adapters (and Adam) in float32
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in tr.params)
        out[dtype] = loss.item(), info
    (l32, i32), (l16, i16) = out[torch.float32], out[torch.bfloat16]
    assert l16 != l32  # bf16 really ran in bf16
    # bf16 keeps 8 mantissa bits (rel. 4e-3 per rounding); over 4 blocks and the KL's log-softmax, the loss of this
    # random model agrees to a few percent
    assert l16 == pytest.approx(l32, rel=5e-2)
    assert i16["l_harmful"] == pytest.approx(i32["l_harmful"], rel=5e-2)


# ---------------------------------------------------------------------- FSDP under torchrun
def test_two_fsdp_gloo_ranks_under_torchrun_train_like_one_process(tmp_path):
    """``Trainer.fit`` of CRL (code settings and crl-tiny's), CRL+mining, RR and stage-0 SFT, 4 AdamW steps each, on
    a tiny random Llama: torchrun with 2 gloo ranks and FSDP2 (the batch split over ranks; once also as plain
    replicas under DDP, once with the latent attack mined inside the DDP step, once on the ``fsdp=true`` recipe's
    sharded twin whose adapters are gathered back into the whole model) against one plain process (~40 s here)."""
    cases = [*fsdp_worker.CASES, "crl_code@replicas", "crl_adv@replicas", "crl_adv@twin"]
    out = tmp_path / "two.pt"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "REPRLAB_QUIET": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(HERE / "fsdp_worker.py"), str(out), *cases]  # fmt: skip
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    two = torch.load(out)
    assert two["world"] == 2
    for case in cases:
        one = fsdp_worker.train(case.split("@")[0], shard=False)
        # float32 sums in another order (per-rank partial sums, all-reduce/all-gather): measured <= 1e-6 relative
        assert two[case]["losses"] == pytest.approx(one["losses"], rel=1e-5), case
        moved = 0.0
        for name, w in one["state"].items():
            # 4 Adam steps at lr 1e-2 amplify last-bit gradient differences on near-zero components: measured
            # <= 2e-5 absolute against moves of up to 3.6e-2
            assert torch.allclose(two[case]["state"][name], w, atol=1e-4, rtol=0), (case, name)
            moved = max(moved, float(w.abs().max()))
        assert moved > 1e-2, case  # training moved the adapters (B starts at 0)


# crl_adv: the latent attack (its module, Adam state, generator and coin flips) resumes too
@pytest.mark.slow  # three torchrun launches of 2 gloo ranks on a tiny Llama: ~60-90 s on the loaded 2-core machine
@pytest.mark.parametrize("case", ["crl_code", "crl_adv"])
def test_a_sharded_run_killed_after_a_checkpoint_resumes_to_the_uninterrupted_end(tmp_path, case):
    """FSDP2 on 2 gloo ranks with DCP checkpoints every 2 steps: 4 steps straight against a run whose processes
    die right after the step-2 checkpoint and a new torchrun that resumes it to step 4. The
    same code path both ways (same ranks, shards and reduction order): the adapters must be bitwise equal and
    the logged losses equal."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "REPRLAB_QUIET": "1"}

    def launch(run_dir, out, kill_at):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(HERE / "fsdp_worker.py"), "resume", str(run_dir), str(out), str(kill_at), case]  # fmt: skip
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        return torch.load(out) if kill_at == 0 else None

    straight = launch(tmp_path / "straight", tmp_path / "straight.pt", 0)
    launch(tmp_path / "killed", tmp_path / "half.pt", 2)
    assert not (tmp_path / "half.pt").exists()  # the processes died before the end
    ckpt = tmp_path / "killed" / "checkpoints" / ("crl_adv" if case == "crl_adv" else "crl") / "step_00000002"
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["kind"] == "dcp" and meta["world_size"] == 2
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "rng_rank1.json"} <= set(meta["files"])
    resumed = launch(tmp_path / "killed", tmp_path / "resumed.pt", 0)
    assert resumed["world"] == 2
    for name, w in straight["state"].items():
        assert torch.equal(resumed["state"][name], w), name
    rows = {k: [json.loads(x) for x in (tmp_path / k / "metrics.jsonl").read_text().splitlines()]
            for k in ("straight", "killed")}  # fmt: skip
    loss = f"{'crl_adv' if case == 'crl_adv' else 'crl'}.loss"
    assert [r[loss] for r in rows["killed"]] == [r[loss] for r in rows["straight"]]
    assert max(float(w.abs().max()) for w in straight["state"].values()) > 1e-2  # training moved the adapters


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process: DCP says so
def test_a_sharded_checkpoint_with_an_edited_file_is_refused_before_dcp_reads_it(tmp_path):
    """The SHA-256 manifest is checked before DCP unpickles ``.metadata`` (one process, no process group)."""
    from reprlab.errors import CheckpointError
    from reprlab.runs.dcp import load_sharded_checkpoint, save_sharded_checkpoint

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    folder = save_sharded_checkpoint(tmp_path / "t", 1, model, opt, extra={"a": 1})
    fresh = torch.nn.Linear(3, 2)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    assert load_sharded_checkpoint(folder, fresh, fresh_opt) == (1, {"a": 1})
    assert torch.equal(fresh.weight, model.weight)
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    (folder / ".metadata").write_bytes((folder / ".metadata").read_bytes() + b"x")
    with pytest.raises(CheckpointError, match=r"\.metadata"):
        load_sharded_checkpoint(folder, fresh, fresh_opt)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_planted_pickle_in_dcp_metadata_does_not_run_even_with_a_rewritten_manifest(tmp_path):
    """DCP's ``.metadata`` is read through a restricted unpickler: a pickle that would create a file is refused
    (and never runs) even when whoever planted it also rewrote ``meta.json``'s sizes and SHA-256s."""
    import json
    import os
    import pickle

    from reprlab.errors import CheckpointError
    from reprlab.runs.checkpoint import sha256_file
    from reprlab.runs.dcp import load_sharded_checkpoint, save_sharded_checkpoint

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    folder = save_sharded_checkpoint(tmp_path / "t", 1, model, opt)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (folder / ".metadata").write_bytes(pickle.dumps(Payload()))
    meta = json.loads((folder / "meta.json").read_text())
    meta["files"][".metadata"] = {"size": (folder / ".metadata").stat().st_size,
                                  "sha256": sha256_file(folder / ".metadata")}  # fmt: skip
    (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="system"):
        fresh = torch.nn.Linear(3, 2)
        load_sharded_checkpoint(folder, fresh, torch.optim.AdamW(fresh.parameters(), lr=0.1))
    assert not marker.exists()


# ---------------------------------------------------------------------- memory estimate
def test_memory_estimate_counts_match_hf_and_peft():
    """Parameter and LoRA counts of the estimate against a real Llama (meta device) and peft on it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from reprlab.methods.crl_safety.scale import ARCHS, Arch

    a = ARCHS["meta-llama/Meta-Llama-3-8B-Instruct"]
    cfg = LlamaConfig(hidden_size=a.d_model, intermediate_size=a.d_ff, num_hidden_layers=a.n_layers,
                      num_attention_heads=a.n_heads, num_key_value_heads=a.n_kv_heads, vocab_size=a.d_vocab,
                      tie_word_embeddings=False)  # fmt: skip
    with torch.device("meta"):
        big = LlamaForCausalLM(cfg)
    assert a.params == sum(p.numel() for p in big.parameters()) == 8_030_261_248  # the 8B model card's count
    small = Arch(3, 64, 224, 4, 2, 300)
    m = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=224, num_hidden_layers=3, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=300, tie_word_embeddings=False))  # fmt: skip
    assert small.params == sum(p.numel() for p in m.parameters())
    peft = add_lora(m, 8, 8, 0.0, blocks=[0, 2])
    assert 2 * small.lora_params_per_block(8) == sum(p.numel() for p in peft.parameters() if p.requires_grad)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_activation_bytes_per_token_match_autograds_saved_tensors(dropout):
    """The per-token, per-block activation count against the bytes autograd actually saves for one Llama block with
    LoRA (bf16 base, fp32 adapters), counted through ``saved_tensors_hooks`` (distinct storages)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from reprlab.methods.crl_safety.scale import Arch

    arch = Arch(1, 256, 896, 8, 2, 300)
    m = LlamaForCausalLM(LlamaConfig(hidden_size=256, intermediate_size=896, num_hidden_layers=1,
                                     num_attention_heads=8, num_key_value_heads=2, vocab_size=300,
                                     attn_implementation="sdpa")).to(torch.bfloat16)  # fmt: skip
    peft = add_lora(m, 4, 4, dropout)
    peft.train()
    n_tok = 64
    x = torch.randn(1, n_tok, 256, dtype=torch.bfloat16)  # the block's input, kept by the caller anyway
    block = peft.base_model.model.model.layers[0]
    pos = torch.arange(n_tok)[None]
    rope = peft.base_model.model.model.rotary_emb(x, pos)
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, position_embeddings=rope, position_ids=pos)
    # weights (base and LoRA) and the block input are held anyway: count only what the forward allocated
    for t in [x, *peft.parameters()]:
        seen.pop(t.untyped_storage().data_ptr(), None)
    measured = sum(v for v in seen.values()) / n_tok
    est = arch.act_bytes_per_token_block(lora_dropout=dropout > 0, r=4)
    # measured 17,684 / 24,340 bytes; the estimate counts every saved tensor, so within 1 % (a kernel or library
    # change that saves another tensor fails here and the README figures need a new look)
    assert est == pytest.approx(measured, rel=0.01), (est, measured)


def test_memory_estimate_of_the_8b_recipe_is_dominated_by_activations_without_checkpointing():
    """Totals of ``crl-llama3-8b`` add up from their parts; checkpointing cuts activations by ~n_layers."""
    from reprlab.methods.crl_safety.scale import ARCHS, memory_estimate
    from reprlab.recipes import get_recipe

    cfg = get_recipe("crl-llama3-8b").build_config()
    arch = ARCHS[cfg.model]
    one, two = memory_estimate(cfg, arch, 1), memory_estimate(cfg, arch, 2)
    assert one["weights"] == pytest.approx(8_030_261_248 * 2 / 1e9)  # bf16 weights, one copy
    assert two["weights"] == pytest.approx(one["weights"] / 2)  # FSDP shards them
    # layers_benign "0:32" reaches hidden state 32 (the last block's output), so all 32 blocks get adapters
    assert one["lora_params_m"] == pytest.approx(32 * arch.lora_params_per_block(16) / 1e6)
    parts = ("weights", "weights_gathered", "lora_and_adamw", "gathered_states", "logits", "activations_ckpt")
    assert one["total_ckpt"] == pytest.approx(sum(one[k] for k in parts))
    assert one["activations_full"] > 10 * one["activations_ckpt"]


@pytest.mark.slow  # two pipelines on a tiny Llama, one under torchrun: ~40 s on the loaded 2-core machine
@pytest.mark.parametrize("select", [False, True])
def test_the_recipe_under_torchrun_gives_one_processs_summary(tmp_path, select):
    """The whole crl pipeline (generate, stage 0, RR, CRL, CRL+mining, every attack) with 2 gloo ranks: each rank
    holds the model, training splits the batches; the summary matches one process. ``select``: with validation
    points (every rank measures, rank 0 writes) and the benign_floor rule, the same steps are chosen."""
    import json

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "REPRLAB_QUIET": "1"}
    worker = str(HERE / "recipe_worker.py")
    extra = ["select"] if select else []
    runs = {
        "one": [sys.executable, worker, str(tmp_path / "one"), *extra],
        "two": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", worker,
                str(tmp_path / "two"), *extra],
    }  # fmt: skip
    for name, cmd in runs.items():
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, (name, res.stderr[-3000:])
    one, two = (json.loads((tmp_path / n / "summary.json").read_text()) for n in runs)
    assert one.keys() == two.keys()
    assert select == ("crl.selected_step" in one)
    for k, v in one.items():
        if isinstance(v, str) or k.split(".")[-1].startswith(
            ("asr", "benign_compliance", "over_refusal", "selected_step", "val_")
        ):
            assert two[k] == v, k  # judged shares: the same replies
        else:
            # float32 sums in another order: KLs of ~1e-6 differ by up to 5e-7 (measured), cosines by < 1e-6
            assert two[k] == pytest.approx(v, rel=1e-3, abs=1e-5), k


@pytest.mark.parametrize("fsdp", [False, True])
def test_the_pipeline_never_copies_a_model(tmp_path, monkeypatch, caplog, fsdp):
    """One copy of the base: the crl pipeline on the tiny Llama runs with ``copy.deepcopy`` of any module > 1 k
    parameters forbidden (the recipe used to deep-copy the base for stage 0). ``fsdp=true`` without torchrun is
    the same run, with a note in the log."""
    import copy

    from test_recipe import TINY, compliant_jsonl

    from reprlab.config import load_config
    from reprlab.methods.crl_safety import recipe as R
    from reprlab.runs import Run

    real = copy.deepcopy

    def guarded(x, *a, **k):
        if isinstance(x, torch.nn.Module) and sum(p.numel() for p in x.parameters()) > 1000:
            raise AssertionError(f"deepcopy of a {type(x).__name__}")
        return real(x, *a, **k)

    monkeypatch.setattr(copy, "deepcopy", guarded)
    t = {
        **TINY,
        "models": ["refusal", "crl"],
        "data": {**TINY["data"], "user_jsonl": compliant_jsonl(tmp_path)},
        "fsdp": fsdp,
    }
    cfg = load_config(R.Config, t)
    with caplog.at_level("INFO"):
        summary = R.run(cfg, Run.create(tmp_path / "run", cfg, "crl-tiny", quiet=True))
    assert "crl.asr_prefill" in summary
    assert ("fsdp=true without a process group" in caplog.text) == fsdp


# ---------------------------------------------------------------------- fsdp=true in the recipe
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "REPRLAB_QUIET": "1"}
LOSS_KEYS = ("loss", "ce_refusal", "ce_benign", "kl", "l_benign", "l_harmful", "attack_loss")


def _torchrun_recipe(folder, model_dir, fault: str = "") -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(HERE / "fsdp_recipe_worker.py"), str(folder), str(model_dir)]  # fmt: skip
    env = {**ENV, "REPRLAB_FAULT": fault} if fault else ENV
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def _metrics(folder) -> list[dict]:
    rows = [json.loads(x) for x in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.endswith("step_seconds")} for r in rows]


def _adapters(folder) -> dict[str, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return {m: load_file(folder / "run" / "adapters" / m / "adapter_model.safetensors")
            for m in fsdp_recipe_worker.MODELS}  # fmt: skip


@pytest.fixture(scope="module")
def fsdp_recipe(tmp_path_factory):
    """The fsdp=true pipeline on a tiny Llama folder: one process (fsdp a logged no-op) and 2 gloo ranks."""
    from reprlab.models.random_llama import random_llama_folder as tiny_llama_folder

    root = tmp_path_factory.mktemp("fsdp_recipe")
    model_dir = tiny_llama_folder(root / "model", initializer_range=0.05)
    fsdp_recipe_worker.main(str(root / "one"), str(model_dir))
    res = _torchrun_recipe(root / "two", model_dir)
    assert res.returncode == 0, res.stderr[-3000:]
    return root, model_dir


@pytest.mark.slow  # the pipeline once in this process and once under torchrun: ~60-90 s on the loaded 2-core machine
def test_fsdp_true_under_torchrun_trains_like_one_process_and_exports_adapters_that_load(fsdp_recipe):
    """Stage 0, CRL and CRL+mining with fsdp=true on 2 gloo ranks (each stage trains a sharded twin, the adapters
    are gathered back for export and evaluation) against one process: the same per-step losses, adapters and
    summary within float32 reordering, and the exported peft adapter loads and gives the one process's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, model_dir = fsdp_recipe
    one, two = _metrics(root / "one"), _metrics(root / "two")
    assert [r["step"] for r in two] == [r["step"] for r in one] == list(range(2 + 2 * 4))
    assert any(r.get("crl_adv.adv") == 1 for r in two)  # the attack was used
    for a, b in zip(one, two):
        assert a.keys() == b.keys()
        for k, v in a.items():
            if k.split(".")[-1] in LOSS_KEYS:
                # float32 sums in another order (per-rank partial sums, gathered states, FSDP's reduce-scatter
                # of the adapters' gradients), compounded over 10 AdamW steps at lr 0.05 and the attack's Adam:
                # measured <= 9.1e-6 relative, 3.8e-6 absolute
                assert b[k] == pytest.approx(v, rel=1e-4, abs=1e-6), (a["step"], k)
    ad1, ad2 = _adapters(root / "one"), _adapters(root / "two")
    for m in ad1:
        assert ad1[m].keys() == ad2[m].keys()
        for name, w in ad1[m].items():
            # Adam divides by the root of its second moment, so a noise-level gradient difference on a near-zero
            # component moves it by up to ~lr (0.05): measured <= 6.5e-5 against values up to 0.3
            assert torch.allclose(ad2[m][name], w, atol=5e-4, rtol=0), (m, name)
    s1, s2 = (json.loads((root / n / "summary.json").read_text()) for n in ("one", "two"))
    assert s1.keys() == s2.keys()
    for k, v in s1.items():
        if isinstance(v, str) or k.split(".")[-1].startswith(("asr", "benign_compliance", "over_refusal")):
            assert s2[k] == v, k
        else:
            assert s2[k] == pytest.approx(v, rel=1e-3, abs=1e-5), k
    tok = AutoTokenizer.from_pretrained(model_dir)
    probe = tok(
        "<|user|>How do I do bad thing 3?</s>\n<|assistant|>Sure, here is",
        add_special_tokens=False,
        return_tensors="pt",
    )["input_ids"]

    def logits(folder):
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        model = base if folder is None else PeftModel.from_pretrained(base, folder).eval()
        with torch.no_grad():
            return model(input_ids=probe).logits

    base = logits(None)
    for m in fsdp_recipe_worker.MODELS:
        got, want = (logits(root / n / "run" / "adapters" / m) for n in ("two", "one"))
        assert (got - base).abs().max() > 1e-2, m  # the adapter moves the logits
        # the adapters' difference through 4 blocks on logits of magnitude ~1: measured <= 7.8e-6
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0, msg=m)


@pytest.mark.slow  # two more torchrun launches of the pipeline: ~60-90 s on the loaded 2-core machine
def test_fsdp_true_run_killed_after_a_sharded_checkpoint_resumes_to_the_uninterrupted_end(
    fsdp_recipe, tmp_path
):
    """Rank 0 is SIGKILLed right after it commits CRL+mining's step-2 checkpoint (torchrun then ends rank 1); a new
    torchrun resumes the folder (stage 0 from its sharded checkpoint, CRL from its finished stage, CRL+mining from
    step 2 with its attack) and ends bitwise where the uninterrupted sharded run ended."""
    root, model_dir = fsdp_recipe
    first_adv = fsdp_recipe_worker.SFT_STEPS + fsdp_recipe_worker.DEFENSE_STEPS  # crl_adv's step offset
    res = _torchrun_recipe(tmp_path, model_dir, fault=f"kill:checkpoint:commit:step_{first_adv + 2:08d}:1")
    assert res.returncode != 0 and not (tmp_path / "summary.json").exists()
    ckpt = tmp_path / "run" / "checkpoints" / "crl_adv" / f"step_{first_adv + 2:08d}"
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["kind"] == "dcp" and meta["world_size"] == 2 and "attack.safetensors" in meta["files"]
    assert not (tmp_path / "run" / "stages" / "eval_crl_adv.json").exists()
    res = _torchrun_recipe(tmp_path, model_dir)
    assert res.returncode == 0, res.stderr[-3000:]
    straight = root / "two"
    assert _metrics(tmp_path) == _metrics(straight)
    a, b = _adapters(tmp_path), _adapters(straight)
    for m in a:
        for name, w in b[m].items():
            assert torch.equal(a[m][name], w), (m, name)
    s1, s2 = (json.loads((d / "summary.json").read_text()) for d in (straight, tmp_path))
    assert s1 == s2
