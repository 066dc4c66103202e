"""The one trainer: every defense runs, diagnostics are right, and 2-rank gloo equals 1 process."""

import copy
import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

from reprlab.methods.otcclip.config import DefenseConfig, ModelConfig, OTConfig, TrainConfig
from reprlab.methods.otcclip.data.mosaic import make_mosaics
from reprlab.methods.otcclip.data.pairs import SignatureIndex
from reprlab.methods.otcclip.data.poison import add_backdoor
from reprlab.methods.otcclip.data.tokenizer import WordTokenizer
from reprlab.methods.otcclip.models.tiny import TinyCLIP
from reprlab.methods.otcclip.training.augment import drop_words
from reprlab.methods.otcclip.training.trainer import Trainer, lr_factor

CFG = ModelConfig(
    patch_size=14,
    width=32,
    layers=1,
    heads=2,
    text_width=32,
    text_layers=1,
    text_heads=2,
    max_len=24,
    embed_dim=16,
)
DCFG = DefenseConfig(
    bank_size=64,
    top_k=4,
    rematch_warmup=1,
    rematch_every=1,
    intra_subset=4,
    safeclip_unimodal_epochs=1,
    ot=OTConfig(n_iters=20),
)


def _data(items, n=32):
    sigs = SignatureIndex()
    pairs = make_mosaics(n, seed=0, source=items, signatures=sigs)
    return add_backdoor(pairs, n_poison=4, target_class=8, trigger="badnets", seed=1, signatures=sigs)


def _trainer(items, defense, epochs=3, batch=8, dist=None, n=32, sgd=False):
    data = _data(items, n)
    tok = WordTokenizer.from_texts(data.captions)
    torch.manual_seed(0)
    model = TinyCLIP(CFG, len(tok))
    tr = Trainer(
        model,
        data,
        tok,
        defense,
        TrainConfig(epochs=epochs, batch_size=batch, warmup_steps=2),
        DCFG,
        seed=0,
        dist=dist,
    )
    if sgd:
        # Adam divides by sqrt(v): float-noise gradients (the attention key bias has an exact gradient of 0)
        # become lr-sized steps, so rank-vs-single equality is checked with SGD, which keeps noise small
        tr.opt = torch.optim.SGD(model.parameters(), lr=0.5)
    return tr


@pytest.mark.parametrize(
    "defense,phases",
    [
        ("none", ["clip", "clip", "clip"]),
        ("roclip", ["clip", "roclip_match", "roclip_match"]),
        ("safeclip", ["unimodal", "clip_lowlr", "safe_split"]),
        ("otcclip", ["otc", "otc_match", "otc_match"]),
    ],
)
def test_every_defense_trains_with_finite_losses_and_sane_diagnostics(items, defense, phases):
    tr = _trainer(items, defense)
    before = [p.detach().clone() for p in tr.model.parameters()]
    stats = [tr.run_epoch(e) for e in range(3)]
    assert [s["phase"] for s in stats] == phases
    assert all(torch.isfinite(torch.tensor(s["loss"])) for s in stats)
    assert any((p != b).any() for p, b in zip(tr.model.parameters(), before))
    for s in stats:
        if "rematch_poison_moved" in s:  # defense quality is tested on planted problems (test_defenses.py)
            assert s["n_poison_seen"] == 4 and s["n_clean_seen"] == 28  # every pair is matched once per epoch
    if defense == "safeclip":  # the logged split is the one the trainer holds
        safe = tr.state.safe
        assert stats[-1]["safe_share"] == float(safe.float().mean())
        assert stats[-1]["poison_in_risky"] == float((~safe[tr.poison]).float().mean())
    if defense in ("roclip", "otcclip"):
        assert len(tr.bank) == min(64, 3 * 32) and tr.examples  # bank filled, examples recorded


def test_rematch_counts_follow_their_definition(items):
    tr = _trainer(items, "otcclip")
    poison_rows = torch.nonzero(tr.poison).flatten()[:2]
    clean_rows = torch.nonzero(~tr.poison).flatten()[:2]
    loc = torch.cat([poison_rows, clean_rows])
    sig = tr.data.sig[loc].clone()
    new_sig = torch.stack([sig[0], torch.tensor(10_000), sig[2], torch.tensor(10_000)])
    new_poison = torch.tensor([True, False, False, False])
    # poison 0 keeps its poison caption; poison 1 moves to a clean, different caption; clean 0 kept; clean 1 not
    assert tr._count(loc, new_sig, new_poison).tolist() == [2, 1, 2, 1]


def test_schedule_and_word_dropout():
    assert lr_factor(0, 10, 100, 0.1) == pytest.approx(0.1) and lr_factor(9, 10, 100, 0.1) == 1.0
    assert lr_factor(100, 10, 100, 0.1) == pytest.approx(0.1)  # cosine ends at min_ratio
    ids = torch.tensor([[5, 6, 7, 0], [5, 0, 0, 0]])
    new, mask = drop_words(ids, ids != 0, torch.Generator().manual_seed(0), p=1.0)
    assert mask.sum(1).tolist() == [1, 1] and new[0, 0] == 5  # always at least one word kept, left-packed


# defenses the 2-rank test trains: OTCCLIP (every parameter gets gradient: DDP's plain mode), RoCLIP and
# SafeCLIP (phases that leave parameters without gradient: DDP with find_unused_parameters)
DDP_DEFENSES = ("otcclip", "roclip", "safeclip")


def _worker(rank, world, init_file, items, out_file):
    from torch.nn.parallel import DistributedDataParallel

    from reprlab.train.dist import DistInfo, init_distributed

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world
    )
    torch.set_num_threads(1)
    info = init_distributed(device="cpu")
    assert info == DistInfo(rank, world, rank, torch.device("cpu"))
    states = {}
    for defense in DDP_DEFENSES:
        tr = _trainer(items, defense, epochs=2, batch=8, dist=info, n=16, sgd=True)
        assert isinstance(tr.ddp, DistributedDataParallel)  # gradients are reduced by PyTorch's DDP
        for e in range(2):
            tr.run_epoch(e)
        states[defense] = {k: v.clone() for k, v in tr.model.state_dict().items()}
    if rank == 0:
        torch.save(states, out_file)
    torch.distributed.destroy_process_group()


def _init(items):
    return _trainer(items, "otcclip", epochs=2, batch=8, n=16).model.state_dict()


@pytest.mark.slow  # spawns 2 processes that import torch: 1-3 min on a shared 2-core machine
def test_two_gloo_ranks_equal_one_process_on_the_same_global_batch(items):
    """OTCCLIP epochs 0 (plain + OT losses) and 1 (re-matching over the gathered pool), RoCLIP (clip, then
    matched text without text-encoder gradient) and SafeCLIP (unimodal without the logit scale's gradient,
    then clip) on 2 CPU ranks under DDP against one process."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ddp.pt")
        mp.spawn(_worker, args=(2, os.path.join(tmp, "init"), items, out), nprocs=2, join=True)
        ddp = torch.load(out)
    for defense in DDP_DEFENSES:
        single = _trainer(items, defense, epochs=2, batch=8, n=16, sgd=True)
        for e in range(2):
            single.run_epoch(e)
        for name, p in single.model.state_dict().items():
            # float32 sums in another order (gathered features, DDP's bucketed all-reduce of the two ranks'
            # gradients, then / 2) after 4 SGD steps: measured <= 1.5e-8 apart here; 1e-5 / 1e-4 leaves room for
            # other CPUs' kernels (the OT solves stop on a tolerance that a half batch may reach elsewhere)
            assert torch.allclose(p, ddp[defense][name], atol=1e-5, rtol=1e-4), (defense, name)
        moved = sum(
            float((p - q).abs().sum())
            for p, q in zip(single.model.state_dict().values(), _init(items).values())
        )
        assert moved > 1e-2, defense  # the comparison is not vacuous: training changed the weights


def checkpoint(trainer) -> tuple[dict, dict]:
    """Copies of what a checkpoint holds: the trainer's modules' and optimisers' state dicts."""
    return (
        copy.deepcopy({k: m.state_dict() for k, m in trainer.modules().items()}),
        copy.deepcopy({k: o.state_dict() for k, o in trainer.optimizers().items()}),
    )


def restore(trainer, saved: tuple[dict, dict]) -> None:
    """Load a :func:`checkpoint` into a fresh trainer, as a resumed run does."""
    modules, opts = saved
    for k, m in trainer.modules().items():
        m.load_state_dict(modules[k])
    for k, o in trainer.optimizers().items():
        o.load_state_dict(opts[k])
