"""Answer-only loss, teacher-forced EM = greedy decoding, and bit-exact resume of training."""

import json
from dataclasses import dataclass

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
