"""Data: the offline testbed, poisoning, and reading the user's image-caption data.

* ``pairs``: ``PairSet`` (image-caption pairs with provenance), ``LabeledSet``, ``SignatureIndex``.
* ``mosaic`` / ``shapes``: the testbeds' items and captions [ours]; ``testbed``: one seed's poisoned training
  pairs and held-out evaluation sets.
* ``triggers`` / ``poison``: backdoor triggers; targeted poisons and backdoors planted in a ``PairSet``.
* ``tokenizer``: our word tokenizer; ``transforms``: decoding to the model's input size, ``uint8`` -> [-1, 1].
* ``datasets``: a user dataset (CSV/TSV/JSONL or shards) loaded into memory (the audit).
* ``shards``: webdataset-layout shards, written and read; ``sources``: shard and table sources streamed in slots.

Poisoning the user's own shards or tables belongs beside ``poison`` (planting) and ``shards`` (writing); a new
streamed format is a new class in ``sources``.
"""
