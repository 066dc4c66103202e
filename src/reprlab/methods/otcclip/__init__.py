"""OTCCLIP: poisoning-robust CLIP pre-training with OT-based caption matching and alignment.

Paper: Zhang, Gao, Bai et al., *Pre-training CLIP against Data Poisoning with Optimal Transport-based
Matching and Alignment*, EMNLP 2025 (arXiv 2509.18717). Only the abstract is public, so the matching
score, pool, losses and every hyper-parameter here are our reconstruction, each a config key whose help
says [ours]; RoCLIP, SafeCLIP and CleanCLIP follow their public code.

The package, from the entry points down (a module imports only from the rows below it, or its own row):

* ``recipe.py``: the entry ``reprlab run otcclip-*`` loads (``Config``, ``preflight``, ``run``,
  ``report_sections``); ``cli.py``: ``reprlab otcclip audit | make-shards | poison | evaluate | flag-probe``;
  ``export.py``: ``reprlab export``'s open_clip / HF folders; ``recipes/*.yaml``: the recipes.
* ``pipeline/``: what a run does, stage by stage (preflight, in-memory and streamed runs, the user-data stages -
  files and poison - one defense's stage, the audit stage and command, the poison, evaluate and flag-probe
  commands, the report).
* ``evaluation/``: zero-shot, linear probe, ASRs; on our testbed or on the user's ImageFolders and poison
  manifest (``folder``); the poison audit; the flag probe (``flag_probe``: which feature test tells flagged
  poisons from flagged clean pairs, epoch by epoch).
* ``training/``: one trainer for every defense, in memory (``trainer``) or streamed from shards in slots and
  windows (``slots``, ``stream``); augmentations.
* ``defenses/``: one file per defense behind a registry (none, RoCLIP, SafeCLIP, CleanCLIP, OTCCLIP), their
  losses (CLIP, in-modality, OT alignment) and matching (caption bank, OT re-matching).
* ``models/``: the feature interface, our tiny CLIP, the Hugging Face and open_clip adapters, the ``model.arch``
  builder, batched embeddings, a run's saved model, its export folders.
* ``data/``: the testbed (mosaics, shapes, poisons, triggers), the word tokenizer, image transforms, user data
  in memory, webdataset shards (read through webdataset, ``shard_reader``) and streamed sources, ImageFolders and
  prompt templates, poisoning user data into shards (``poison_shards``, ``poison_io``), Fashion-MNIST written as
  user files.
* ``config/``: the recipe's frozen dataclass configs, one module per YAML section (``data``, ``model``,
  ``train``, ``defense``, ``stream``, ``poison``, ``eval``) composed into ``Config``; resolved once and handed
  down section by section.

Where new work goes: a defense is a new file in ``defenses/``; an architecture or an export format a module in
``models/`` (and a branch in ``models/build.py``); a data format a source in ``data/sources.py``; poisoning the
user's own data is ``data/poison_shards.py`` beside ``data/poison.py`` and ``data/shards.py``, with its command in
``cli.py`` and its body in ``pipeline/``; evaluation on the user's images is ``evaluation/folder.py``;
multi-process training in ``training/``.
``tests/test_import_graph.py`` keeps the layers free of import circles and every module under 400 lines.
"""
