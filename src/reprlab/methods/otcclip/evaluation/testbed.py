"""Evaluation on our testbed's held-out sets: the summary keys ``zeroshot_acc``, ``asr_targeted``,
``asr_backdoor`` and ``linear_probe_acc`` of every ``otcclip-*`` recipe with a testbed.

Evaluation on the user's own images (ImageFolders of class folders, a poison manifest) is :mod:`.folder`, filling
the same keys from :mod:`.metrics`.
"""

from __future__ import annotations

from reprlab.methods.otcclip.config import Config
from reprlab.methods.otcclip.data.mosaic import class_prompts
from reprlab.methods.otcclip.data.testbed import Testbed, trigger_params
from reprlab.methods.otcclip.evaluation import metrics as ev


def evaluate_testbed(model, tok, bed: Testbed, cfg: Config, probe: bool) -> dict[str, float]:
    """Zero-shot, ASRs and (optionally, it is the slow one) the linear probe of ``model`` on the testbed ``bed``;
    ``tok`` is the tokenizer the model trained with (any of :mod:`..models.build`'s)."""
    class_emb = ev.class_embeddings(model, tok, class_prompts(bed.pairs.class_names), cfg.model.max_len)
    out = {
        "zeroshot_acc": ev.zero_shot_accuracy(model, bed.eval_set, class_emb),
        "asr_targeted": ev.asr_targeted(model, bed.targets, class_emb),
        "asr_backdoor": ev.asr_backdoor(
            model,
            bed.eval_set,
            bed.backdoor_class,
            cfg.data.trigger,
            cfg.seed + 2,
            class_emb,
            **trigger_params(cfg.data),
        ),
    }
    if probe:
        out["linear_probe_acc"] = ev.linear_probe_accuracy(
            model, bed.probe_train, bed.eval_set, cfg.data.probe_c, cfg.data.probe_max_iter
        )
    return out
