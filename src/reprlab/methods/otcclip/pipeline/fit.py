"""One defense's stage of a run: build the model from the shared seed, train it epoch by epoch (checkpointed
under the defense's tag, so ``--resume`` continues where a run stopped), evaluate, and return its metrics and
re-assigned-caption examples. The in-memory and the streamed trainers share the epoch loop (:func:`fit`).
"""

from __future__ import annotations

import torch

from reprlab.methods.otcclip.config import Config
from reprlab.methods.otcclip.data.testbed import Testbed
from reprlab.methods.otcclip.data.tokenizer import WordTokenizer
from reprlab.methods.otcclip.defenses import REGISTRY
from reprlab.methods.otcclip.evaluation.concept import nn_concept_match
from reprlab.methods.otcclip.evaluation.testbed import evaluate_testbed
from reprlab.methods.otcclip.models.build import build_model
from reprlab.methods.otcclip.models.embed import embed_images, embed_texts
from reprlab.methods.otcclip.training.stream import StreamTrainer
from reprlab.methods.otcclip.training.trainer import Trainer
from reprlab.runs import Run


def evaluate(model, tok, bed, cfg: Config, folder, probe: bool) -> dict:
    """The summary keys on the testbed ``bed``, else on the user's folders (``folder``), else none."""
    if bed is not None:
        return evaluate_testbed(model, tok, bed, cfg, probe=probe)
    if folder is not None:
        return folder(model, tok, cfg.model.max_len, probe=probe)
    return {}


def fit(
    defense, cfg: Config, run: Run, trainer, model, tok, bed, final_loss: bool = False, folder=None
) -> dict:
    """The epoch loop both trainers share: resume from the defense's last epoch checkpoint, train, evaluate each
    epoch on ``bed`` (or on the user's folders, ``folder``, with ``eval.every_epoch``), checkpoint; then the
    final metrics plus the last re-matching / split diagnostics."""
    start, history = 0, []
    if run.resume and (state := run.load_checkpoint(trainer.modules(), trainer.optimizers(), tag=defense)):
        start, extra = state
        history, trainer.examples = extra["history"], extra["examples"]
    for epoch in run.progress(range(start, cfg.train.epochs), total=cfg.train.epochs - start, desc=defense):
        stats = trainer.run_epoch(epoch)
        if bed is not None or (folder is not None and cfg.eval.every_epoch):
            stats.update(evaluate(model, tok, bed, cfg, folder, probe=False))
        history.append(stats)
        run.log(epoch, defense=defense, **stats)
        run.logger.info("%s epoch %d: %s", defense, epoch, {k: v for k, v in stats.items() if k != "epoch"})
        run.save_checkpoint(
            epoch + 1,
            trainer.modules(),
            trainer.optimizers(),
            extra={"history": history, "examples": trainer.examples},
            tag=defense,
            keep_every=cfg.train.keep_every or None,
        )
    final = evaluate(model, tok, bed, cfg, folder, probe=True)
    if final_loss:
        final["final_loss"] = history[-1]["loss"] if history else float("nan")
    matches = [h for h in history if "rematch_poison_moved" in h]
    if matches:
        final["rematch_poison_moved"] = matches[-1]["rematch_poison_moved"]
        final["rematch_clean_kept"] = matches[-1]["rematch_clean_kept"]
    for key in sorted({k for h in history for k in h if k.startswith("data_skipped_")}):
        final[key] = sum(int(h.get(key, 0)) for h in history)  # every epoch's skips, by reason
    flags = [h for h in history if "poison_flagged" in h]  # OTCCLIP's consensus flag, at the end of training
    if flags:
        final["flag_poison_flagged"] = flags[-1]["poison_flagged"]
        for kind in ("targeted", "backdoor"):
            if f"{kind}_flagged" in flags[-1]:
                final[f"flag_{kind}_flagged"] = flags[-1][f"{kind}_flagged"]
        final["flag_share"] = flags[-1]["flagged_share"]
    splits = [h for h in history if "poison_in_risky" in h]
    if splits:
        final["safeclip_poison_in_risky"] = splits[-1]["poison_in_risky"]
    return final


def concept_match(model, tok, trainer, bed: Testbed, cfg: Config) -> float:
    """:func:`nn_concept_match` of the trained ``model`` on the training pairs (clean pairs with true captions),
    with a bank of ``defense.bank_size`` captions."""
    pairs = bed.pairs
    keep = pairs.kind == 0
    if bed.noisy_rows is not None:
        keep[bed.noisy_rows] = False
    img = embed_images(model, pairs.images)
    txt = embed_texts(model, *tok.encode(pairs.captions, trainer.max_len))
    rows = torch.nonzero(keep).flatten()
    return nn_concept_match(img, txt, pairs.sig, rows, cfg.defense.bank_size, cfg.seed)


def train_defense(defense: str, cfg: Config, run: Run, bed: Testbed, tok: WordTokenizer, dist=None) -> dict:
    """Train and evaluate one defense, resuming from its last epoch checkpoint; under torchrun ``dist`` splits
    every global batch across the ranks."""
    torch.manual_seed(cfg.seed)  # same initial weights for every defense
    channels = bed.pairs.images.shape[1]
    model = build_model(cfg.model, len(tok), channels).to(run.device)
    pairs = bed.pairs.select(bed.pairs.kind == 0) if REGISTRY[defense].poison_free else bed.pairs
    trainer = Trainer(
        model, pairs, tok, defense, cfg.train, cfg.defense, cfg.seed, dist=dist, clean=bed.clean
    )
    final = fit(defense, cfg, run, trainer, model, tok, bed)
    final["nn_concept_match"] = concept_match(model, tok, trainer, bed, cfg)
    examples = [dict(e, image=pairs.images[e["index"]].tolist()) for e in trainer.examples]
    return {"metrics": final, "examples": examples}


def train_defense_stream(
    defense,
    cfg: Config,
    run: Run,
    bed,
    tok,
    source,
    n_samples,
    channels,
    dist,
    clean_source=None,
    folder=None,
) -> dict:
    """Train one defense from the stream (resuming from its last epoch checkpoint) and evaluate it (on ``bed``,
    else on the user's folders, ``folder``); ``clean_source``: CleanCLIP's clean fine-tuning stream
    (``stream.clean_source`` or the written clean set)."""
    torch.manual_seed(cfg.seed)  # same initial weights for every defense
    model = build_model(cfg.model, len(tok), channels).to(run.device)
    trainer = StreamTrainer(
        model,
        source,
        tok,
        defense,
        cfg.train,
        cfg.defense,
        cfg.seed,
        cfg.stream,
        n_samples,
        dist=dist,
        clean=clean_source,
    )
    final = fit(defense, cfg, run, trainer, model, tok, bed, final_loss=True, folder=folder)
    return {"metrics": final, "examples": trainer.examples}
