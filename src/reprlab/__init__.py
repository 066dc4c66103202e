"""reprlab: representation-level robustness research on one shared core.

Methods (each under ``reprlab.methods``): OTCCLIP (poisoning-robust CLIP), Reason to Rote (memorisation of
noisy labels in reasoning), CRL safety (contrastive representation defense for chat models), Norm-IC
(squared norm vs information content). Shared core: ``reprlab.ot``, ``reprlab.models``, ``reprlab.hooks``,
``reprlab.runs``, ``reprlab.report``, ``reprlab.config`` and the ``reprlab`` CLI.
"""

__version__ = "0.1.0"
