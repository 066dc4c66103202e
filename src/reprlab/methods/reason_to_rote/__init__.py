"""Reason to Rote (Du et al., EMNLP 2025, arXiv 2507.04782): memorisation of noisy labels in reasoning tasks.

FDA (``fda.py``) and THR (``thr.py``) generators, tensorisation (``dataset.py``), training (``train.py``),
evaluation (``evaluate.py``), analyses (``analyses.py`` on top of :mod:`reprlab.interp`), and the recipe
entries ``recipe.py`` (FDA) and ``recipe_thr.py`` (THR).
"""
