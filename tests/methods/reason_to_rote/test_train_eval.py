"""Answer-only loss, teacher-forced EM = greedy decoding, and bit-exact resume of training."""

import json
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from reprlab.methods.reason_to_rote.dataset import Vocab, tensorize
from reprlab.methods.reason_to_rote.evaluate import answer_matches, greedy_decode
from reprlab.methods.reason_to_rote.fda import FDA_VOCAB, FDAConfig, generate_fda
from reprlab.methods.reason_to_rote.train import TrainConfig, answer_loss, train
from reprlab.models.gpt import GPT, GPTConfig
from reprlab.runs import Run

V = Vocab(FDA_VOCAB, "char")


def _data(n=200):
    ds = generate_fda(FDAConfig(n_train=n, n_test=50, noise_rate=0.1), seed=0)
    return tensorize(ds.splits["train"], V), tensorize(ds.splits["test"], V)


def _model(seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(d_vocab=len(V), n_ctx=16, n_layers=1, d_model=16, n_heads=2, d_mlp=32))


def test_answer_loss_covers_answer_tokens_only():
    b, _ = _data()
    b = b.select(torch.arange(8))
    m = _model()
    logits = m(b.ids[:, :-1])
    # oracle: plain cross-entropy over the 6 answer targets (positions 10..15) of each row
    ref = F.cross_entropy(logits[:, 9:15].reshape(-1, len(V)), b.ids[:, 10:16].reshape(-1))
    torch.testing.assert_close(answer_loss(m, b), ref)


def test_teacher_forced_em_equals_greedy_decoding():
    b, _ = _data()
    b = b.select(torch.arange(32))
    m = _model(3).eval()
    decoded = greedy_decode(m, b.ids[:, :10], 6)
    target = torch.cat([b.ids[:, :10], decoded], 1)
    assert answer_matches(m, target, b).all()  # the model's own greedy output always matches
    wrong = target.clone()
    wrong[:, 12] = (wrong[:, 12] + 1) % len(V)
    assert not answer_matches(m, wrong, b).all(1).any()  # any changed answer token breaks EM


@dataclass(frozen=True)
class _Cfg:
    seed: int = 0


def test_resume_is_bit_exact(tmp_path):
    tr, te = _data()
    cfg = TrainConfig(steps=6, batch_size=32, eval_every=3, ckpt_every=3, snapshot_every=0, warmup_steps=2)
    m1 = _model()
    train(m1, tr, te, cfg, Run.create(tmp_path / "a", _Cfg(), "t", quiet=True), seed=0)
    # interrupted run: 3 steps, then a resumed run to 6 from the step-3 checkpoint
    m2 = _model()
    short = TrainConfig(**{**cfg.__dict__, "steps": 3})
    train(m2, tr, te, short, Run.create(tmp_path / "b", _Cfg(), "t", quiet=True), seed=0)
    m3 = _model(seed=99)  # different init: everything must come from the checkpoint
    r = Run.create(tmp_path / "b", _Cfg(), "t", resume=True, quiet=True)
    train(m3, tr, te, cfg, r, seed=0)
    for (n, p1), p3 in zip(m1.state_dict().items(), m3.state_dict().values()):
        torch.testing.assert_close(p1, p3, rtol=0, atol=0, msg=n)
    lines = (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
    assert [eval(x.replace("NaN", "0"))["step"] for x in lines] == [3, 6]


def test_early_stop_is_kept_on_resume(tmp_path):
    tr, te = _data()
    # stop_memorized=0 stops at the first evaluation (any memorisation rate >= 0)
    cfg = TrainConfig(
        steps=10, batch_size=32, eval_every=2, ckpt_every=5, snapshot_every=0, stop_memorized=0.0
    )
    res = train(_model(), tr, te, cfg, Run.create(tmp_path / "s", _Cfg(), "t", quiet=True), seed=0)
    assert res.stopped_early and res.step == 2
    again = train(
        _model(), tr, te, cfg, Run.create(tmp_path / "s", _Cfg(), "t", resume=True, quiet=True), seed=0
    )
    assert again.stopped_early and again.step == 2  # a resumed run does not train past the early stop


def test_stop_rule_needs_generalisation_as_well_as_memorisation(tmp_path):
    tr, te = _data()
    # stop_memorized=0 holds at the first evaluation; a validation EM threshold of 1.01 never does, so the
    # run must train to the end instead of stopping on memorisation alone (seed 0 once memorised without generalising: test EM 0.13)
    cfg = TrainConfig(steps=6, batch_size=32, eval_every=2, ckpt_every=5, snapshot_every=0, stop_memorized=0.0,
                      stop_generalized=1.01)  # fmt: skip
    res = train(_model(), tr, te, cfg, Run.create(tmp_path / "g", _Cfg(), "t", quiet=True), seed=0, val=te)
    assert not res.stopped_early and res.step == 6
    rows = [eval(x.replace("NaN", "0")) for x in (tmp_path / "g" / "metrics.jsonl").read_text().splitlines()]
    assert all("val_em" in r for r in rows)
    # with the threshold at 0 it stops at the first evaluation, as before
    cfg0 = TrainConfig(**{**cfg.__dict__, "stop_generalized": 0.0})
    res0 = train(_model(), tr, te, cfg0, Run.create(tmp_path / "h", _Cfg(), "t", quiet=True), seed=0, val=te)
    assert res0.stopped_early and res0.step == 2


def test_dynamics_summary_orders_generalisation_before_memorisation():
    from reprlab.methods.reason_to_rote.recipe import dynamics_summary

    rows = [{"step": 100, "noisy_memorized": 0.0, "noisy_true_answer": 0.2},
            {"step": 200, "noisy_memorized": 0.1, "noisy_true_answer": 0.9},
            {"step": 300, "noisy_memorized": 0.6, "noisy_true_answer": 0.95},  # after the 0.5 crossing: ignored
            {"step": 400, "noisy_memorized": 1.0, "noisy_true_answer": 0.0}]  # fmt: skip
    assert dynamics_summary(rows) == {"peak_noisy_true_answer": 0.9, "step_peak_noisy_true": 200,
                                      "step_memorized_half": 300}  # fmt: skip
    never = dynamics_summary(rows[:2])
    assert "step_memorized_half" not in never and never["peak_noisy_true_answer"] == 0.9
    assert dynamics_summary([{"step": 1, "noisy_memorized": float("nan"), "noisy_true_answer": 0.5}]) == {}


def test_max_steps_truncates_without_changing_the_schedule(tmp_path):
    tr, te = _data()
    full = TrainConfig(steps=8, batch_size=32, eval_every=2, ckpt_every=4, snapshot_every=0, warmup_steps=2)
    cut = TrainConfig(**{**full.__dict__, "max_steps": 5})
    res = train(_model(), tr, te, cut, Run.create(tmp_path / "c", _Cfg(), "t", quiet=True), seed=0)
    assert res.step == 5 and not res.stopped_early
    train(_model(), tr, te, full, Run.create(tmp_path / "f", _Cfg(), "t", quiet=True), seed=0)

    def lr(d):
        lines = (tmp_path / d / "metrics.jsonl").read_text().splitlines()
        return [json.loads(x)["lr"] for x in lines]

    # oracle: the truncated run logs the same learning rates as the full run up to its end (same horizon)
    assert lr("c")[:2] == lr("f")[:2] and len(lr("c")) == 3  # evaluations at steps 2, 4 and the last step 5


def _ddp_worker(rank, world, init_file, run_dir, out_file):
    import os

    from torch.nn.parallel import DistributedDataParallel

    from reprlab.methods.reason_to_rote import train as train_mod
    from reprlab.train.dist import init_distributed

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world
    )
    torch.set_num_threads(1)
    wrapped = []
    real = train_mod.wrap_ddp
    train_mod.wrap_ddp = lambda m: wrapped.append(real(m)) or wrapped[-1]
    tr, te = _data()
    model = _model()
    run = Run.create(run_dir, _Cfg(), "t", quiet=True)
    train(model, tr, te, _DDP_CFG, run, seed=0, dist=init_distributed(device="cpu"))
    assert isinstance(wrapped[0], DistributedDataParallel)  # gradients are reduced by PyTorch's DDP
    if rank == 0:
        torch.save(model.state_dict(), out_file)
    torch.distributed.destroy_process_group()


_DDP_CFG = TrainConfig(steps=8, batch_size=32, eval_every=1, ckpt_every=8, snapshot_every=0, warmup_steps=2)


@pytest.mark.slow  # spawns 2 processes that import torch: ~20-60 s on a shared 2-core machine
def test_two_gloo_ranks_train_like_one_process(tmp_path):
    """2 CPU ranks under DDP, each on half of every global batch (the halves hold different numbers of answer
    tokens only if items differ in length: the loss divides by the global count either way), against one
    process: the same logged loss at every step and the same final weights."""
    import torch.multiprocessing as mp

    tr, te = _data()
    one = _model()
    train(one, tr, te, _DDP_CFG, Run.create(tmp_path / "one", _Cfg(), "t", quiet=True), seed=0)
    mp.spawn(
        _ddp_worker,
        args=(2, str(tmp_path / "init"), tmp_path / "two", tmp_path / "two.pt"),
        nprocs=2,
        join=True,
    )
    two = torch.load(tmp_path / "two.pt")
    losses = {
        k: [json.loads(x)["loss"] for x in (tmp_path / k / "metrics.jsonl").read_text().splitlines()]
        for k in ("one", "two")
    }
    assert len(losses["one"]) == 8
    # float32 sums in another order (each rank's token sum, DDP's all-reduce of the two gradients): the logged
    # loss is rounded to 5 decimals, so the trajectories agree to 1e-4 (measured: identical at that rounding)
    assert losses["two"] == pytest.approx(losses["one"], abs=1e-4)
    for name, p in one.state_dict().items():
        # float32 gradients in another summation order, then AdamW (which divides by sqrt(v), so a noise-level
        # gradient difference on a near-zero-gradient entry can move it by up to ~lr = 1e-3): measured max
        # difference after 8 steps 2.5e-7; 1e-4 absolute leaves room for other CPUs' kernels
        torch.testing.assert_close(two[name], p, atol=1e-4, rtol=1e-3, msg=name)
    moved = max(
        float((p - q).abs().max()) for p, q in zip(one.state_dict().values(), _model().state_dict().values())
    )
    assert moved > 1e-3  # training changed the weights: the comparison is not vacuous


def test_answer_mask_is_built_on_the_batch_device():
    """A batch moved to another device builds its mask there (on CUDA a CPU ``arange`` failed the first GPU
    training step); the meta device stands in for CUDA here: mixing it with a CPU tensor raises the same way."""
    ds = generate_fda(FDAConfig(n_train=8, n_test=4, noise_rate=0.0), seed=0)
    batch = tensorize(ds.splits["train"], Vocab(ds.manifest["vocab"], ds.manifest["tokenizer"]))
    mask = batch.to("meta").answer_mask()
    assert mask.device.type == "meta" and mask.shape == batch.ids.shape
    assert torch.equal(batch.answer_mask().sum(1), batch.answer_len)  # one mask entry per answer token
