"""The poison-free oracle [ours]: plain CLIP trained on the pairs not marked as poisons, the rest of the run
unchanged (the same initial weights, schedule and evaluation).

Not a defense (it reads the poison labels no defense may see) but the reference every poisoning table needs:
its ASRs are the matched null, what the evaluation reports when nothing was learnt from the poisons (a target
image a clean model already puts in the target class, triggered images it misreads as the target), and its
accuracies what the clean part of the data can teach. Run it beside the defenses
(``"defenses=[none,otcclip,oracle]"``); the recipe's floor claims compare against it.
"""

from __future__ import annotations

from reprlab.methods.otcclip.defenses.base import Defense, register


@register
class PoisonFreeOracle(Defense):
    name = "oracle"
    poison_free = True
