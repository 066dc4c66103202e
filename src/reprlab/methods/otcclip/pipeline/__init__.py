"""The recipe's orchestration: what ``reprlab run otcclip-*`` and ``reprlab otcclip ...`` do, stage by stage,
with the library parts (data, models, defenses, training, evaluation).

* ``preflight``: the checks before a run folder exists.
* ``run``: a run end to end (testbed, each defense, audit); ``run_stream``: its streamed path.
* ``fit``: one defense's stage (model, epochs with checkpoints, evaluation).
* ``audit``: the audit stage of a run, and ``reprlab otcclip audit`` on a user dataset.
* ``user_data``: the ``files`` and ``poison`` stages of a run on user data, and its folder evaluation's defaults.
* ``poison``, ``evaluate``: ``reprlab otcclip poison`` and ``reprlab otcclip evaluate RUN_DIR``.
* ``report``: the report sections, from a run folder's saved files.

A new ``reprlab otcclip`` command is a function in ``cli.py`` whose body lives here, built from the library parts.
"""
