"""Evaluation metrics: zero-shot top-1, linear probe, attack success rates [the RoCLIP/SafeCLIP/CleanCLIP
protocols], for any model exposing ``encode_image(float (B, C, H, W)) -> ImageFeatures`` and
``encode_text(ids, mask) -> TextFeatures``.

* Zero-shot [CLIP]: class embedding w_c = normalised mean of the normalised prompt-template embeddings;
  predict argmax_c cos(u(x), w_c).
* Linear probe [CLIP/RoCLIP protocol]: scikit-learn ``LogisticRegression(C, max_iter)`` on frozen,
  normalised global image embeddings, fitted on train items, scored on test items.
* ASR_targeted: share of target images predicted as their target class.
* ASR_backdoor: share of triggered test images of true class != target predicted as the target.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from reprlab.methods.otcclip.data.pairs import LabeledSet
from reprlab.methods.otcclip.data.poison import TargetSet
from reprlab.methods.otcclip.data.tokenizer import WordTokenizer
from reprlab.methods.otcclip.data.triggers import apply_trigger
from reprlab.methods.otcclip.models.embed import embed_images, embed_texts


def class_embeddings(model, tokenizer: WordTokenizer, prompts: list[list[str]], max_len: int) -> torch.Tensor:
    """Prompt-ensembled class embeddings ``(K, d)`` from ``prompts[class][template]``."""
    k, t = len(prompts), len(prompts[0])
    ids, mask = tokenizer.encode([p for row in prompts for p in row], max_len)
    emb = embed_texts(model, ids, mask).view(k, t, -1)
    return F.normalize(emb.mean(1), dim=-1)


def predict(model, images: torch.Tensor, class_emb: torch.Tensor) -> torch.Tensor:
    """Zero-shot class ids ``(N,)``."""
    return (embed_images(model, images) @ class_emb.T).argmax(1)


def zero_shot_accuracy(model, test: LabeledSet, class_emb: torch.Tensor) -> float:
    return float((predict(model, test.images, class_emb) == test.labels).float().mean())


def linear_probe_accuracy(
    model, train: LabeledSet, test: LabeledSet, c: float = 1.0, max_iter: int = 1000
) -> float:
    """Logistic regression on frozen normalised embeddings (C and max_iter documented in the config)."""
    from sklearn.linear_model import LogisticRegression  # lazy: slow import, only the probe needs it

    xtr, xte = embed_images(model, train.images).numpy(), embed_images(model, test.images).numpy()
    clf = LogisticRegression(C=c, max_iter=max_iter)
    clf.fit(xtr, train.labels.numpy())
    return float(np.mean(clf.predict(xte) == test.labels.numpy()))


def asr_targeted(model, targets: TargetSet, class_emb: torch.Tensor) -> float:
    """(1/T) sum_t 1[argmax_c cos(u(x_t), w_c) = y_t]."""
    return float((predict(model, targets.images, class_emb) == targets.target).float().mean())


def asr_backdoor(
    model,
    test: LabeledSet,
    target_class: int,
    trigger: str,
    seed: int,
    class_emb: torch.Tensor,
    patch: int = 8,
    **params,
) -> float:
    """Share of triggered test images of true class != target that are classified as the target.

    ``trigger``, ``seed``, ``patch`` and ``params`` (:class:`~..data.triggers.TriggerParams`
    fields) as in training, so the test trigger is the trained one.
    """
    keep = test.labels != target_class
    if not keep.any():
        raise ValueError("backdoor ASR needs test images whose class is not the target")
    triggered = apply_trigger(test.images[keep], trigger, seed, patch, **params)
    return float((predict(model, triggered, class_emb) == target_class).float().mean())
