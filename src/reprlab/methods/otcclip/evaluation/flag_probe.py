"""What the model's features tell about OTCCLIP's flagged pairs at one epoch [ours; docs/otcclip_testbed.md,
"What the features tell at the release"].

The consensus flag holds pairs out of the cross-modal loss and later releases those that score like the accepted
pairs. On the testbed the poisons are known, so each kept epoch checkpoint (``train.keep_every``) can be asked
which feature test, read from that epoch's model alone, would tell the flagged backdoor poisons from the flagged
clean pairs (AUROC, backdoor = positive): a diagnostic for designing the flag, never an input to it.

Tests (a score per pair; an AUROC above 0.5 means poisons score higher, below 0.5 lower; either way far from 0.5
is what would let a rule separate them):

* ``support``: minus the consensus score the flag and the release read (``consensus.consensus_scores``).
* ``image_support``: the same with the roles swapped (the captions of the image's nearest images).
* ``own_cosine``: the pair's image-caption cosine.
* ``blend_cosine``: the mean cosine of the pair's caption with its image blended half and half into each of
  ``n_blend`` accepted pairs' images (STRIP's superimposition, Gao et al. 2019): a learned trigger survives the
  blend.
* ``occlusion_drop``: the largest fall of the own-pair cosine when one ``block`` x ``block`` square (stride
  ``stride``) is blanked: a local trigger carries the pair's fit.

And what re-assigning the flagged pairs' captions would teach (OTCCLIP's re-matching, ``rematch_whole_set``, over the
accepted pairs' captions, the own caption left out): the share of flagged clean pairs with a true caption that
get a caption of their own concept, and of flagged backdoor poisons that get one of the target concept.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from reprlab.methods.otcclip.data.pairs import BACKDOOR, CLEAN
from reprlab.methods.otcclip.defenses.blend import accepted_backgrounds, blend_cosine
from reprlab.methods.otcclip.defenses.consensus import consensus_scores
from reprlab.methods.otcclip.defenses.matching import rematch_whole_set
from reprlab.methods.otcclip.defenses.release import released, releases, veto, veto_seed
from reprlab.methods.otcclip.models.embed import embed_images, embed_texts

TESTS = ("support", "image_support", "own_cosine", "blend_cosine", "occlusion_drop")


@dataclass(frozen=True)
class FlagProbe:
    """One epoch's answer. ``epoch``: the checkpoint after ``epoch`` epochs, i.e. the state the flag update of
    epoch ``epoch`` starts from. Counts are of flagged, not held, clean or backdoor pairs (targeted poisons are
    copies of a few images and left out). ``released``: how many pairs of every kind the release of that epoch hands
    back (0 before ``flag_release_epoch``; outside the flag's own epochs, where the trainer flags before it releases,
    the trainer logs the same number as ``released``), ``released_clean`` / ``released_backdoor`` of them clean /
    backdoor. ``auroc``: test -> AUROC of
    backdoor against clean among the flagged (NaN without both). ``target_clean_flagged``: the flagged share of
    the clean pairs whose caption names the backdoor's target concept; ``other_clean_flagged``: of all other
    clean pairs. ``rematch_clean_own_concept``: the share of flagged clean pairs with a true caption whose
    re-matched caption has their concept; ``rematch_backdoor_to_target``: of flagged backdoor poisons, the share
    re-matched to a target-concept caption (module docstring)."""

    epoch: int
    flagged_clean: int
    flagged_backdoor: int
    released: int
    released_clean: int
    released_backdoor: int
    auroc: dict[str, float] = field(default_factory=dict)
    target_clean_flagged: float = float("nan")
    other_clean_flagged: float = float("nan")
    rematch_clean_own_concept: float = float("nan")
    rematch_backdoor_to_target: float = float("nan")


@torch.no_grad()
def occlusion_drop(model, images: torch.Tensor, txt: torch.Tensor, block: int = 16, stride: int = 8):
    """``(R,)``: the largest fall of the image-caption cosine (``images uint8 (R, C, H, W)``, ``txt (R, d)``)
    when one ``block`` x ``block`` square, moved by ``stride``, is set to 0."""
    if len(images) == 0:
        return torch.zeros(0)
    own = (embed_images(model, images) * txt).sum(1)
    h, w = images.shape[-2:]
    drop = torch.full((len(images),), float("-inf"))
    for r in range(0, max(h - block, 0) + 1, stride):
        for c in range(0, max(w - block, 0) + 1, stride):
            x = images.clone()
            x[:, :, r : r + block, c : c + block] = 0
            drop = torch.maximum(drop, own - (embed_images(model, x) * txt).sum(1))
    return drop


@torch.no_grad()
def probe_epoch(
    model, pairs, ids, mask, safe, held, dcfg, epoch: int, n_blend: int = 8, seed: int = 0, noisy=None
) -> FlagProbe:
    """The probe at one epoch: ``model`` with that epoch's weights, in eval mode, ``pairs`` the training :class:`PairSet`,
    ``ids``/``mask (N, pos)`` its captions as the trainer tokenised them, ``safe``/``held bool (N,)`` the flag
    state of the checkpoint, ``dcfg`` OTCCLIP's defense config, ``seed`` the run's seed (the blend test's
    backgrounds, and the release veto's as the trainer drew them), ``noisy bool (N,)`` the testbed's alt-text noise
    (those captions are not true, so they are left out of the re-matching's concept share)."""
    img, txt = embed_images(model, pairs.images), embed_texts(model, ids, mask)
    voters = safe if dcfg.flag_vouch == "unflagged" else None
    score = consensus_scores(img, txt, dcfg.flag_k, dcfg.flag_duplicate_cos, voters=voters)
    kind = pairs.kind
    back = released(dcfg, score, safe, img, held) if releases(dcfg, epoch) and (~safe).any() else None
    if back is not None:  # the trainer's veto, with the backgrounds it drew (the run's seed)
        back = veto(dcfg, back, safe, img, model, pairs.images, txt, veto_seed(seed, epoch))
    back = torch.zeros_like(safe) if back is None else back
    rows = torch.nonzero(~safe & ~held & ((kind == CLEAN) | (kind == BACKDOOR))).flatten()
    y = kind[rows] == BACKDOOR
    tests = {"support": -score[rows], "own_cosine": (img[rows] * txt[rows]).sum(1)}
    side = consensus_scores(img, txt, dcfg.flag_k, dcfg.flag_duplicate_cos, side="image")
    tests["image_support"] = -side[rows]
    # the backgrounds are accepted pairs' images, so that a flagged trigger is not blended into every probe image
    bgs = accepted_backgrounds(pairs.images, safe, n_blend, seed)
    tests["blend_cosine"] = blend_cosine(model, pairs.images[rows], txt[rows], bgs)
    tests["occlusion_drop"] = occlusion_drop(model, pairs.images[rows], txt[rows])
    clean = kind == CLEAN
    bd_sig = pairs.sig[kind == BACKDOOR]
    target_sig = torch.mode(bd_sig).values if len(bd_sig) else None  # the caption concept the backdoor names
    target, other = float("nan"), float("nan")
    if target_sig is not None:
        on_target = clean & (pairs.sig == target_sig)
        target = float((~safe)[on_target].float().mean()) if on_target.any() else float("nan")
        rest = clean & ~on_target
        other = float((~safe)[rest].float().mean()) if rest.any() else float("nan")
    noisy = torch.zeros_like(safe) if noisy is None else noisy
    flagged = ~safe & ~held
    true_clean = torch.nonzero(flagged & clean & ~noisy).flatten()
    poisons = torch.nonzero(flagged & (kind == BACKDOOR)).flatten()
    pool = torch.nonzero(safe).flatten()
    own_concept = to_target = float("nan")
    if len(pool) and len(true_clean) + len(poisons):
        asked = torch.cat([true_clean, poisons])
        dev = next(model.parameters()).device
        got = rematch_whole_set(model, pairs.images, ids, mask, dcfg, dev, rows=asked, pool=pool)[
            "index"
        ].cpu()
        got_c, got_p = got[: len(true_clean)], got[len(true_clean) :]
        if len(true_clean):
            own_concept = float((pairs.sig[got_c] == pairs.sig[true_clean]).float().mean())
        if len(poisons):
            to_target = float((pairs.sig[got_p] == target_sig).float().mean())
    return FlagProbe(
        epoch=epoch,
        flagged_clean=int((~y).sum()),
        flagged_backdoor=int(y.sum()),
        released=int(back.sum()),
        released_clean=int((back & clean).sum()),
        released_backdoor=int((back & (kind == BACKDOOR)).sum()),
        auroc={name: _auroc(y, tests[name]) for name in TESTS},
        target_clean_flagged=target,
        other_clean_flagged=other,
        rematch_clean_own_concept=own_concept,
        rematch_backdoor_to_target=to_target,
    )


def _auroc(positive: torch.Tensor, score: torch.Tensor) -> float:
    from sklearn.metrics import roc_auc_score

    if positive.all() or not positive.any():
        return float("nan")
    return float(roc_auc_score(positive.numpy(), score.double().numpy()))
