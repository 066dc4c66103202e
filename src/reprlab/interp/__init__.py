"""Interpretability analyses on named hook sites: logit lens, probes, INLP, attribution patching, neurons.

Every function takes a model that :mod:`reprlab.hooks` understands (our :class:`reprlab.models.gpt.GPT`
or a Hugging Face causal LM) and returns a result dataclass with diagnostics.
"""
