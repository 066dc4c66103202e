"""Evaluation of a trained CLIP: zero-shot, linear probe and attack success rates, and the poison audit.

* ``metrics``: zero-shot (prompt ensemble), linear probe (scikit-learn), ASR_targeted, ASR_backdoor, for any model
  of :mod:`..models.features`' interface and any labelled image set.
* ``testbed``: those metrics on our testbed's held-out sets (the recipes' summary keys).
* ``folder``: the same keys on the user's ImageFolders (class names, prompt templates) and poison manifest.
* ``audit``: ranking a dataset's pairs by how much better another caption fits (OTCCLIP's matching score).
"""
