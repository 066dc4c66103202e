"""OTCCLIP: poisoning-robust CLIP pre-training with OT-based caption matching and alignment.

Paper: Zhang, Gao, Bai et al., *Pre-training CLIP against Data Poisoning with Optimal Transport-based
Matching and Alignment*, EMNLP 2025 (arXiv 2509.18717). Only the abstract is public, so the matching
score, pool, losses and every hyper-parameter here are our reconstruction (``shared/papers/otcclip.md``
§1.1), each a config key whose docstring says [ours].

Modules (one concept each):

* ``tokenizer``: word-level tokenizer [ours].
* ``mosaic`` / ``shapes``: the offline testbeds (Fashion-MNIST mosaics, generated shapes) [ours].
* ``poison``: targeted poisoning and BadNets/blended backdoors [RoCLIP/CleanCLIP protocol].
* ``model``: tiny CLIP (ViT + text transformer) exposing patch and token features; ``hf_adapter`` wraps a
  Hugging Face ``CLIPModel``.
* ``losses`` / ``matching``: CLIP InfoNCE, OT alignment losses, OT re-matching and RoCLIP NN matching.
* ``trainer``: one trainer for the defenses none / roclip / safeclip / otcclip.
* ``evaluate``: zero-shot, linear probe, ASR, re-matching quality.
* ``recipe``: the ``otcclip-*`` recipe entry; ``audit`` / ``cli``: ``reprlab otcclip audit``.
"""
