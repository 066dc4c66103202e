"""Data: the offline testbed, poisoning, and reading the user's image-caption data.

* ``pairs``: ``PairSet`` (image-caption pairs with provenance), ``LabeledSet``, ``SignatureIndex``.
* ``web`` / ``mosaic`` / ``shapes``: the testbeds' items and captions [ours] (``web``: single items with
  paraphrased captions and alt-text noise, recipe otcclip-tiny); ``testbed``: one seed's poisoned training
  pairs and held-out evaluation sets.
* ``triggers`` / ``poison``: backdoor triggers; targeted poisons and backdoors planted in a ``PairSet``.
* ``tokenizer``: our word tokenizer; ``transforms``: decoding to the model's input size, ``uint8`` -> [-1, 1].
* ``datasets``: a user dataset (CSV/TSV/JSONL or shards) loaded into memory (the audit).
* ``shards``: webdataset-layout shards, written and read; ``sources``: shard and table sources streamed in slots.
* ``folder`` / ``templates``: the user's ImageFolders (class names, images decoded with a pixel limit); CLIP's 80
  ImageNet prompt templates or a template file.
* ``poison_shards`` / ``poison_io``: targeted poisons and a backdoor planted in the user's shards or table, written
  as shards with a manifest of what was planted; brace patterns, the shard writer, the manifest reader.
* ``fashion_files``: Fashion-MNIST written as a user's files (PNGs, captions.csv, ImageFolders) [ours].

A new streamed format is a new class in ``sources``.
"""
