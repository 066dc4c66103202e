"""CleanCLIP's clean fine-tuning set (``data.clean_finetune_pairs``): its fine-tuning epochs train on the clean
set with the in-modal term, earlier epochs on the poisoned pairs; other defenses ignore the set bit for bit;
resuming across the phase switch is bitwise.

Checked by breaking it on purpose (then restoring it):

* the trainer's ``_use`` made a no-op (fine-tuning silently on the poisoned pairs), and separately
  ``CleanCLIP.clean_phases = ()`` -> ``..._finetunes_on_the_clean_set_...`` fails (loss is the poisoned set's);
* the in-modal term dropped from ``CleanCLIP.step`` -> the same test fails (no ``inmodal`` term, loss too low).
"""

import json

import pytest
import torch
import torch.nn.functional as F

from reprlab.methods.otcclip.config import DefenseConfig, OTConfig, TrainConfig
from reprlab.methods.otcclip.data.mosaic import make_mosaics
from reprlab.methods.otcclip.data.pairs import CLEAN, PairSet, SignatureIndex
from reprlab.methods.otcclip.data.poison import add_backdoor
from reprlab.methods.otcclip.data.tokenizer import WordTokenizer
from reprlab.methods.otcclip.models.tiny import TinyCLIP
from reprlab.methods.otcclip.training.trainer import Trainer

from .planted import ADJ, CLASSES, DIM, TRAIN, PlantedCLIP, image_class, planted_pairs, symmetric_infonce
from .test_trainer import CFG, DCFG, checkpoint, restore


def clean_planted(n_per_class: int = 4) -> PairSet:
    """``4 * n_per_class`` correctly captioned planted pairs (no poison), class = row // n_per_class."""
    cls = [r // n_per_class for r in range(4 * n_per_class)]
    caps = [f"a {ADJ[r % 3]} photo of a {CLASSES[c]}" for r, c in enumerate(cls)]
    images = torch.stack([torch.full((1, 8, 8), 40 + 50 * c, dtype=torch.uint8) for c in cls])
    n = len(cls)
    return PairSet(
        images, caps, torch.full((n,), CLEAN), torch.tensor(cls), torch.arange(n), class_names=CLASSES
    )


def _planted(defense: str, clean: PairSet | None, **dcfg) -> Trainer:
    pairs = planted_pairs()
    tok = WordTokenizer.from_texts(pairs.captions)
    cfg = DefenseConfig(
        bank_size=64, top_k=4, lambda_inter=0.0, lambda_intra=0.0, ot=OTConfig(n_iters=20), **dcfg
    )
    return Trainer(PlantedCLIP(tok), pairs, tok, defense, TRAIN, cfg, seed=0, clean=clean)


def _rows_ce(z: torch.Tensor, scale: float) -> float:
    logits = scale * z @ z.T
    return float(-(logits.diagonal() - torch.logsumexp(logits, 1)).mean())


def _expected(pairs: PairSet, scale: float, inmodal_weight: float) -> tuple[float, float]:
    """(CLIP loss, in-modal loss) of the oracle on the whole set (one global batch; views are identical)."""
    u = F.one_hot(image_class(pairs), DIM).double()
    w = F.one_hot(pairs.sig, DIM).double()
    return symmetric_infonce(u, w, scale), 0.5 * (_rows_ce(u, scale) + _rows_ce(w, scale))


def test_cleanclip_pretrains_on_the_poisoned_pairs_then_finetunes_on_the_clean_set_with_its_inmodal_term():
    clean = clean_planted()
    tr = _planted("cleanclip", clean, cleanclip_start_epoch=1, cleanclip_inmodal_weight=0.5)
    # epoch 0 (phase clip): plain CLIP on the poisoned training pairs (4 cat images captioned as dogs)
    scale = float(tr.model.scale().detach())
    s0 = tr.run_epoch(0)
    poisoned_clip, _ = _expected(planted_pairs(), scale, 0.5)
    assert s0["phase"] == "clip" and s0["loss"] == pytest.approx(poisoned_clip, abs=1e-5)
    # epoch 1 (phase cleanclip): the CleanCLIP objective on the clean set, never on the poisoned pairs
    scale = float(tr.model.scale().detach())
    s1 = tr.run_epoch(1)
    clip_clean, inmodal_clean = _expected(clean, scale, 0.5)
    clip_poisoned, inmodal_poisoned = _expected(planted_pairs(), scale, 0.5)
    assert abs(clip_clean - clip_poisoned) > 0.1  # the two hypotheses are distinguishable
    assert s1["phase"] == "cleanclip"
    assert s1["loss_clip"] == pytest.approx(clip_clean, abs=1e-5)
    assert s1["loss_inmodal"] == pytest.approx(inmodal_clean, abs=1e-5)
    assert s1["loss"] == pytest.approx(clip_clean + 0.5 * inmodal_clean, abs=1e-5)
    # and back on the poisoned pairs if the phase is plain CLIP again (the switch is per phase)
    scale = float(tr.model.scale().detach())
    assert tr.run_epoch(0)["loss"] == pytest.approx(_expected(planted_pairs(), scale, 0.5)[0], abs=1e-5)


def test_a_clean_set_smaller_than_the_training_pairs_is_cycled_in_whole_permutations():
    """Fine-tuning epochs keep the pre-training step count (same lr schedule) and no batch repeats an item."""
    pairs = planted_pairs()
    tok = WordTokenizer.from_texts(pairs.captions)
    train = TrainConfig(epochs=3, batch_size=4, warmup_steps=1, shift=0, brightness=0.0, word_dropout=0.0)
    clean = clean_planted(n_per_class=2)  # 8 pairs: 2 batches per permutation, 4 steps per epoch
    tr = Trainer(
        PlantedCLIP(tok),
        pairs,
        tok,
        "cleanclip",
        train,
        DefenseConfig(cleanclip_start_epoch=1),
        seed=0,
        clean=clean,
    )
    tr._use("cleanclip")
    batches = list(tr.global_batches(1, "cleanclip", {}))
    assert len(batches) == tr.steps_per_epoch == 4
    assert all(len(set(b.tolist())) == 4 for b in batches)
    assert torch.bincount(torch.cat(batches), minlength=8).tolist() == [2] * 8
    with pytest.raises(ValueError, match="exceeds the 2 clean fine-tuning pairs"):
        Trainer(PlantedCLIP(tok), pairs, tok, "cleanclip", train, DefenseConfig(), 0, clean=_first(clean, 2))
    with pytest.raises(ValueError, match="holds poisoned pairs"):
        Trainer(PlantedCLIP(tok), pairs, tok, "cleanclip", train, DefenseConfig(), 0, clean=pairs)


def _first(p: PairSet, n: int) -> PairSet:
    return PairSet(p.images[:n], p.captions[:n], p.kind[:n], p.sig[:n], p.image_id[:n], p.class_names)


def _mosaic_trainer(items, defense, clean=None, start=1):
    sigs = SignatureIndex()
    pairs = add_backdoor(
        make_mosaics(32, seed=0, source=items, signatures=sigs), 4, 8, "badnets", 1, sigs
    )  # fmt: skip
    tok = WordTokenizer.from_texts(pairs.captions)
    torch.manual_seed(0)
    model = TinyCLIP(CFG, len(tok))
    dcfg = DefenseConfig(**{**DCFG.__dict__, "cleanclip_start_epoch": start})
    train = TrainConfig(epochs=3, batch_size=8, warmup_steps=2)
    return Trainer(model, pairs, tok, defense, train, dcfg, seed=0, clean=clean)


def _clean_mosaics(items, n=16):
    return make_mosaics(n, seed=5, source=items)


@pytest.mark.parametrize("defense", ["none", "roclip", "safeclip", "otcclip"])
def test_other_defenses_ignore_the_clean_set_bit_for_bit(items, defense):
    a, b = _mosaic_trainer(items, defense), _mosaic_trainer(items, defense, clean=_clean_mosaics(items))
    for epoch in range(2):
        assert a.run_epoch(epoch) == b.run_epoch(epoch)
    for (name, p), q in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(p, q), name


def test_cleanclip_resumes_bitwise_across_the_switch_to_the_clean_set(items):
    """Checkpoint after the last pre-training epoch (weights + optimiser), reload into a fresh trainer, fine-tune:
    same weights as the uninterrupted run; and the fine-tuning really used the clean set (weights differ from
    a run without one)."""
    clean = _clean_mosaics(items)
    straight = _mosaic_trainer(items, "cleanclip", clean)
    straight.run_epoch(0)
    saved = checkpoint(straight)
    for e in (1, 2):
        straight.run_epoch(e)
    resumed = _mosaic_trainer(items, "cleanclip", clean)
    restore(resumed, saved)
    for e in (1, 2):
        resumed.run_epoch(e)
    for (name, p), q in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(p, q), name
    without = _mosaic_trainer(items, "cleanclip")
    for e in range(3):
        without.run_epoch(e)
    assert not torch.equal(
        without.model.state_dict()["logit_scale"], straight.model.state_dict()["logit_scale"]
    )


@pytest.mark.slow
def test_recipe_cleanclip_with_a_clean_set_resumes_across_the_phase_switch(tmp_path):
    """``reprlab run`` level: a run killed after CleanCLIP's last pre-training epoch resumes from its checkpoint
    (weights, optimiser, RNG) into the clean fine-tuning epochs and reproduces the uninterrupted summary."""
    import shutil

    from reprlab.methods.otcclip import recipe
    from reprlab.runs import Run

    from .test_recipe import _cfg

    cfg = _cfg(
        [
            "defenses=[cleanclip]",
            "audit_defense=",
            "data.clean_finetune_pairs=40",
            "defense.cleanclip_start_epoch=1",
        ]
    )
    run = Run.create(tmp_path / "r", cfg, "otcclip-mosaic-tiny", quiet=True)
    summary = recipe.run(cfg, run)
    data = json.loads((run.dir / "analysis" / "data.json").read_text())
    assert data["n_clean_finetune"] == 40
    log = [json.loads(line) for line in (run.dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in log] == ["clip", "cleanclip"] and "loss_inmodal" in log[1]
    (run.dir / "stages" / "cleanclip.json").unlink()
    shutil.rmtree(run.checkpoints("cleanclip")[-1])
    assert len(run.checkpoints("cleanclip")) == 1  # only the pre-training epoch's
    resumed = recipe.run(cfg, Run.create(tmp_path / "r", cfg, "otcclip-mosaic-tiny", resume=True, quiet=True))
    for k, v in summary.items():
        assert resumed[k] == pytest.approx(v, abs=1e-6), k


def test_cleanclip_lr_scale_scales_the_fine_tuning_epochs_only():
    lrs = {}
    for scale in (1.0, 10.0):
        tr = _planted("cleanclip", clean_planted(), cleanclip_start_epoch=1, cleanclip_lr_scale=scale)
        for epoch in (0, 1):
            tr.step(torch.arange(16), epoch, 0, tr.phase(epoch))
            lrs[scale, epoch] = tr.opt.param_groups[0]["lr"]
    assert lrs[10.0, 0] == lrs[1.0, 0]
    assert lrs[10.0, 1] == pytest.approx(10 * lrs[1.0, 1])
